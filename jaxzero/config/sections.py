"""The config's sections: typed, frozen dataclasses, one per concern, and their defaults.

Presets are a few lines derived from :func:`base` with ``dataclasses.replace``.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from jaxzero.models.llama import LlamaConfig

# Stage and hybrid flag for each FSDP/DeepSpeed spelling.
STRATEGIES: dict[str, tuple[int, bool]] = {
    "NO_SHARD": (0, False),
    "ZERO1": (1, False),
    "SHARD_GRAD_OP": (2, False),
    "FULL_SHARD": (3, False),
    "HYBRID_SHARD_ZERO2": (2, True),
    "HYBRID_SHARD": (3, True),
}

Dtype = Literal["float32", "bfloat16", "float16"]
MemoryKind = Literal["device", "pinned_host"]


@dataclasses.dataclass(frozen=True)
class ZeroConfig:
  # 0 = DDP, 1 = optimizer state sharded, 2 = + gradients, 3 = + parameters.
  stage: Literal[0, 1, 2, 3] = 3
  # FSDP spelling; when set it decides stage and hybrid (empty = use `stage`).
  strategy: Literal["", "NO_SHARD", "ZERO1", "SHARD_GRAD_OP", "FULL_SHARD",
                    "HYBRID_SHARD_ZERO2", "HYBRID_SHARD"] = ""
  # Hybrid: shard over `fsdp` only and replicate over `replica`.
  hybrid: bool = False
  # Dtype of gradients and of the gradient-accumulation buffers.
  grad_dtype: Dtype = "float32"
  # Dtype gradients are reduced in across devices (FSDP's reduce_dtype);
  # empty = grad_dtype.
  reduce_dtype: Literal["", "float32", "bfloat16", "float16"] = ""
  # A model_factory model's parameters with fewer elements stay whole on every
  # device (DeepSpeed's stage3_param_persistence_threshold + 1: it keeps those of at most
  # its value whole). The built-in Llama family places every parameter by its own
  # annotations.
  min_shard_size: int = 100_000

  @property
  def resolved(self) -> tuple[int, bool]:
    """(stage, hybrid) after applying `strategy`."""
    return STRATEGIES[self.strategy] if self.strategy else (self.stage, self.hybrid)


def strategy_name(stage: int, hybrid: bool) -> str:
  """The FSDP/DeepSpeed name of (stage, hybrid), e.g. (3, False) -> FULL_SHARD."""
  names = {value: name for name, value in STRATEGIES.items()}
  return names.get((stage, hybrid), f"HYBRID_ZERO{stage}")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  replica: int = 1
  fsdp: int = -1  # -1 = all remaining devices
  # Tensor (Megatron) and sequence parallelism, innermost: inside a host.
  # Divides the devices, the heads, the MLP width and the vocabulary.
  tensor: int = 1
  # Pipeline stages: the layer stack split into this many groups of consecutive
  # layers, one per device along the `pipeline` axis (outside `fsdp`: across hosts).
  # Divides the layers; the step's grad_accum micro-batches flow through the stages.
  pipeline: int = 1
  # Context parallelism: every activation's sequence split over this many devices,
  # which share their rows of the batch; attention gathers keys and values over them.
  # ZeRO shards the state over them too. Divides train.seq_len.
  context: int = 1


@dataclasses.dataclass(frozen=True)
class ContextConfig:
  # How attention reaches the keys and values of the other devices of mesh.context.
  # "all_gather": each device gathers them all (one collective a layer; the whole
  # sequence's keys and values on each device while it attends). "ring": they travel
  # round the devices one part a hop, each hop's attention overlapping the next hop.
  strategy: Literal["all_gather", "ring"] = "all_gather"
  # Lay the sequence out in 2 x mesh.context chunks, device c holding chunks c and
  # 2C-1-c, so that each does the same causal attention work (MaxText's default).
  load_balance: bool = True


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
  # How the micro-batches flow through the stages (mesh.pipeline > 1). "gpipe": every
  # micro-batch forward, then every one backward (the backward is the forward's
  # gradient); each stage holds the inputs of all its micro-batches. "1f1b": each
  # micro-batch starts back as soon as it leaves the last stage; a stage keeps at most
  # mesh.pipeline stage inputs (whatever the micro-batches), with GPipe's bubble.
  # "interleaved": GPipe round the stages virtual_stages times, each stage running
  # 1/virtual_stages of its layers a time, which divides the bubble by about
  # virtual_stages (jaxzero.parallel.pipeline).
  schedule: Literal["gpipe", "1f1b", "interleaved"] = "gpipe"
  virtual_stages: int = 1  # chunks of layers per stage, for "interleaved"


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  steps: int = 100
  global_batch: int = 16  # sequences per optimizer step
  grad_accum: int = 1
  seq_len: int = 128
  lr: float = 3e-4
  warmup_steps: int = 10
  min_lr_ratio: float = 0.1
  weight_decay: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  clip_norm: float = 1.0  # 0 disables clipping
  # A step whose loss or gradient norm is not finite never updates the state.
  # "stop": the run then stops with an error naming the step; "skip": it goes
  # on, and stops only after `max_nonfinite` such steps in a row.
  nonfinite: Literal["stop", "skip"] = "stop"
  max_nonfinite: int = 5
  log_every: int = 1
  # "adamw": decoupled weight decay. "adam": weight_decay is an L2 term added to
  # the gradient before Adam's moments (torch.optim.Adam; DeepSpeed adam_w_mode=false).
  optimizer: Literal["adamw", "adam"] = "adamw"
  # "warmup_cosine": linear warmup from 0 to lr, cosine to lr x min_lr_ratio at
  # `steps`. DeepSpeed's schedules, with its formulas: "warmup_constant"
  # (WarmupLR), "warmup_linear_decay" (WarmupDecayLR: linearly back to the
  # warmup's start at `steps`), "warmup_cosine_ds" (WarmupCosineLR: cosine to
  # lr x min_lr_ratio at `steps`).
  schedule: Literal["warmup_cosine", "warmup_constant", "warmup_linear_decay",
                    "warmup_cosine_ds"] = "warmup_cosine"
  # DeepSpeed's schedules only: the warmup's shape, and where it starts as a
  # fraction of lr (DeepSpeed's warmup_min_lr / warmup_max_lr, or warmup_min_ratio).
  warmup_type: Literal["log", "linear"] = "log"
  warmup_min_ratio: float = 0.0


@dataclasses.dataclass(frozen=True)
class PrecisionConfig:
  compute: Dtype = "bfloat16"  # dtype of the compute copy of the weights
  # The built-in models' seven projections: "default" (in `compute`) or "fp8": e4m3
  # operands, e5m2 gradients, per-tensor current scaling (jaxzero.models.fp8).
  matmul: Literal["default", "fp8"] = "default"
  # float16 only, with DeepSpeed's fp16 keys and meanings: the loss is scaled
  # before the backward pass. 0 = dynamic: from 2**initial_scale_power, halved
  # after `hysteresis` overflowing steps (each skipped), doubled after
  # `loss_scale_window` steps without one, never below min_loss_scale; > 0 = static.
  loss_scale: float = 0.0
  initial_scale_power: int = 16
  loss_scale_window: int = 1000
  hysteresis: int = 2
  consecutive_hysteresis: bool = False  # refill the hysteresis after every good step
  min_loss_scale: float = 1.0

  @property
  def scales_loss(self) -> bool:
    return self.compute == "float16"


@dataclasses.dataclass(frozen=True)
class RematConfig:
  policy: Literal["none", "full", "save_matmuls", "save_attention", "offload_matmuls"] = "none"
  # jaxzero.Engine only (set in Python): a Flax NNX module class whose every call is
  # checkpointed with `policy` (FSDP's transformer_layer_cls); None = the engine's own
  # per-layer hook. Not a file or command-line setting: a class is not text.
  block: type | None = None


@dataclasses.dataclass(frozen=True)
class OffloadConfig:
  # Where the fp32 master weights and Adam moments live: device memory, pinned
  # host memory (ZeRO-Offload), or files in `nvme_dir` (ZeRO-Infinity's NVMe tier).
  optimizer: Literal["device", "pinned_host", "nvme"] = "device"
  # The compute copy at rest (stage 3): device memory, pinned host memory streamed one
  # layer at a time, or "nvme": ZeRO-Infinity's parameter tier (with optimizer=nvme),
  # parameters and gradients on disk too, the model run one layer at a time.
  params: Literal["device", "pinned_host", "nvme"] = "device"
  # offload.optimizer=nvme: a directory on local disk (each process keeps its
  # shards in a subdirectory it makes, and deletes when the run ends).
  nvme_dir: str = ""
  # offload.optimizer=pinned_host: the ZeRO-Offload paper's one-step delayed parameter
  # update (DPU): step n's update runs on the host while the device computes step n+1
  # on the weights before it (off: every step is exact).
  delayed_update: bool = False
  # DPU's warm-up, as the ZeRO-Offload paper's: the first steps, where the gradients
  # change fastest, are exact; DPU runs from the step after this many.
  delayed_update_after: int = 40
  # offload.optimizer=pinned_host: the share of the layers whose optimizer state lives
  # on the host (the last ones); the rest stays on the device (ZeRO-Offload++ Twin-Flow).
  optimizer_fraction: float = 1.0


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """LoRA (PEFT's): the model's weights frozen, low-rank adapters trained."""
  # Each adapter's rank; 0 trains every weight (no LoRA).
  rank: int = 0
  # The adapters' output is scaled by alpha / rank (PEFT's lora_alpha).
  alpha: float = 16.0
  # Dropout on the adapters' input in training (PEFT's lora_dropout): each element
  # dropped with this probability, from keys drawn per row from the seed and the step
  # (the same on any mesh and grad_accum).
  dropout: float = 0.0
  # The projections adapted: "all-linear" (q, k, v, o, gate, up, down), comma-separated
  # names (also PEFT's q_proj ... down_proj), or a regex over those names.
  targets: str = "all-linear"
  # How the frozen base is stored: "" = the compute dtype; "nf4" (QLoRA: NormalFloat-4
  # with double-quantized block scales) or "int8" (blockwise), the seven projections of
  # every layer quantized and dequantized one layer at a time inside the step.
  base_dtype: Literal["", "bfloat16", "float32", "int8", "nf4"] = ""
  # A PEFT adapter directory (adapter_config.json, adapter_model.safetensors) the
  # adapters start from, instead of B = 0; its rank, alpha and targets must be these.
  init_from: str = ""


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  every: int = 0  # 0 = only at the end and on preemption
  keep: int = 3
  # False: nothing is saved when the run reaches its last step (a benchmark's or a
  # smoke test's run, whose state is not worth the disk); a preempted run still saves.
  at_end: bool = True
  # A latest checkpoint that fails verification: "fallback" resumes from the
  # newest one that verifies (moving the damaged one to checkpoints.damaged/),
  # "refuse" stops with the error and changes nothing.
  on_damaged: Literal["fallback", "refuse"] = "fallback"


@dataclasses.dataclass(frozen=True)
class DataConfig:
  # "stdlib": the Python standard library's own source, byte-level tokens; or a
  # file, directory or glob of .txt/.jsonl/.parquet files (see jaxzero.data.tokens).
  source: str = "stdlib"
  max_bytes: int = 16_000_000  # "stdlib" only
  tokenizer: str = "byte"  # "byte" or the path of a Hugging Face tokenizer.json
  text_field: str = "text"  # the JSON-lines field / Parquet column holding the text
  # Where tokenized files are cached; empty = WORKDIR/data_cache. Share one
  # directory between runs to tokenize a corpus once.
  cache_dir: str = ""
  eos_token: str = ""  # document separator; empty = the tokenizer's usual end-of-text
  # Held-out text for evaluation (eval.*): the last `eval_fraction` of the token
  # stream (training uses the rest), or a separate source tokenized the same way.
  eval_fraction: float = 0.0
  eval_source: str = ""
  # "text": documents joined into one stream. Fine-tuning records (jaxzero.data.chat):
  # "chat" (`messages`, rendered by the chat template) or "prompt_completion"; the loss
  # is on the assistant's or the completion's tokens only.
  format: str = "text"
  packing: bool = False  # fine-tuning: fill each row with whole examples (segment ids)
  overlong: str = "truncate"  # fine-tuning: an example longer than a row: "truncate" | "drop"
  # Fine-tuning: a .jinja file or tokenizer_config.json; empty = the one beside data.tokenizer.
  chat_template: str = ""


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  every: int = 0  # steps between evaluations of the held-out split; 0 = never
  batches: int = 4  # global micro-batches (train.global_batch / grad_accum rows) per evaluation


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
  # Unset (empty, 0, -1) = from JAXZERO_COORDINATOR / JAXZERO_NUM_PROCESSES /
  # JAXZERO_PROCESS_ID, else from SLURM, Open MPI or Kubernetes, else one process.
  coordinator_address: str = ""  # host:port where process 0 serves the coordinator
  num_processes: int = 0
  process_id: int = -1
  timeout_s: int = 300  # how long every process waits for all the others to join
  # Process 0 names the processes that stay in one phase (compile, step k, save k,
  # eval k) longer than stall_s (0 = 5 x the median step time, at least 60 s;
  # 300 s before the first step), again at each further stall_s; stall_exit_s > 0
  # stops the run after that long.
  stall_s: float = 0.0
  stall_exit_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class InitConfig:
  # A Hugging Face Llama directory (config.json + safetensors) whose weights
  # start training; the model.* fields must match its config.json. A run with
  # a checkpoint of its own resumes from that instead.
  hf_checkpoint: str = ""


@dataclasses.dataclass(frozen=True)
class LogConfig:
  # Weights & Biases (pip install 'jaxzero[wandb]'): the project to log to; empty = off.
  wandb: str = ""
  wandb_entity: str = ""
  wandb_name: str = ""  # empty = the workdir's name
  wandb_group: str = ""
  wandb_mode: Literal["online", "offline", "disabled"] = "online"


@dataclasses.dataclass(frozen=True)
class ProfileConfig:
  # "START:END" (e.g. "20:23"): a jax.profiler trace of steps START..END in WORKDIR/profile.
  steps: str = ""

  @property
  def window(self) -> tuple[int, int] | None:
    if not self.steps:
      return None
    start, _, end = self.steps.partition(":")
    return int(start), int(end or start)


@dataclasses.dataclass(frozen=True)
class Config:
  model: LlamaConfig = LlamaConfig()
  init: InitConfig = InitConfig()
  zero: ZeroConfig = ZeroConfig()
  mesh: MeshConfig = MeshConfig()
  context: ContextConfig = ContextConfig()
  pipeline: PipelineConfig = PipelineConfig()
  train: TrainConfig = TrainConfig()
  precision: PrecisionConfig = PrecisionConfig()
  remat: RematConfig = RematConfig()
  offload: OffloadConfig = OffloadConfig()
  lora: LoraConfig = LoraConfig()
  checkpoint: CheckpointConfig = CheckpointConfig()
  data: DataConfig = DataConfig()
  eval: EvalConfig = EvalConfig()
  distributed: DistributedConfig = DistributedConfig()
  log: LogConfig = LogConfig()
  profile: ProfileConfig = ProfileConfig()
  seed: int = 0
  # Your own model instead of the Llama family: "module:function", the function
  # returning (model, loss_fn) or a dict of jaxzero.Engine's model arguments (model,
  # loss_fn, init_args, rules, min_shard_size); loss_fn(model, tokens [B, T+1]). The
  # module is looked up beside the config file too. See docs/any-model.md.
  model_factory: str = ""


def base() -> Config:
  return Config()
