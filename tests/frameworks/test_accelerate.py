"""`--accelerate-config fsdp.yaml`: each FSDP sharding strategy (name or 1-5, and
FSDP2's reshard_after_forward) maps to its zero.strategy; offload, checkpointing
and precision map; bad input is one line with exit code 2."""

import logging

import pytest
import yaml

from jaxzero import config, migrate
from jaxzero import train as train_cli
from jaxzero.errors import ConfigError
from jaxzero.frameworks import accelerate
from jaxzero.frameworks.translated_file import apply_file
from jaxzero.parallel import mesh as mesh_lib

from processes import TINY

# What `accelerate config` writes for FSDP on one 8-GPU machine.
ACCELERATE_FSDP = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
downcast_bf16: 'no'
enable_cpu_affinity: false
fsdp_config:
  fsdp_activation_checkpointing: false
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_backward_prefetch: BACKWARD_PRE
  fsdp_cpu_ram_efficient_loading: true
  fsdp_forward_prefetch: false
  fsdp_offload_params: false
  fsdp_sharding_strategy: {strategy}
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_sync_module_states: true
  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
  fsdp_use_orig_params: true
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 2
num_processes: 16
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""


def from_yaml(text: str) -> config.Config:
  base = config.load(TINY)
  result = accelerate.translate(yaml.safe_load(text), base).apply(base)
  config.validate(result)
  return result


@pytest.mark.parametrize("strategy, expected", [
    ("FULL_SHARD", "FULL_SHARD"), ("SHARD_GRAD_OP", "SHARD_GRAD_OP"), ("NO_SHARD", "NO_SHARD"),
    ("HYBRID_SHARD", "HYBRID_SHARD"), ("_HYBRID_SHARD_ZERO2", "HYBRID_SHARD_ZERO2"),
    ("HYBRID_SHARD_ZERO2", "HYBRID_SHARD_ZERO2"),
    (1, "FULL_SHARD"), (2, "SHARD_GRAD_OP"), (3, "NO_SHARD"), (4, "HYBRID_SHARD"),
    (5, "HYBRID_SHARD_ZERO2"),
])
def test_each_sharding_strategy_maps_to_its_zero_strategy(strategy, expected):
  cfg = from_yaml(ACCELERATE_FSDP.format(strategy=strategy))
  assert cfg.zero.strategy == expected
  assert cfg.precision.compute == "bfloat16" and cfg.remat.policy == "none"
  assert cfg.offload == config.OffloadConfig()
  if expected.startswith("HYBRID"):  # shard inside a machine, replicate across the two
    assert (cfg.mesh.replica, cfg.mesh.fsdp) == (2, -1)
  else:
    assert cfg.mesh == config.load(TINY).mesh


@pytest.mark.parametrize("reshard, expected", [(True, "FULL_SHARD"), (False, "SHARD_GRAD_OP")])
def test_fsdp2_reshard_after_forward(reshard, expected):
  text = ("distributed_type: FSDP\nmixed_precision: 'no'\nfsdp_config:\n  fsdp_version: 2\n"
          f"  fsdp_reshard_after_forward: {str(reshard).lower()}\n"
          "  fsdp_activation_checkpointing: true\n  fsdp_offload_params: false\n")
  cfg = from_yaml(text)
  assert cfg.zero.strategy == expected
  assert cfg.precision.compute == "float32" and cfg.remat.policy == "full"


@pytest.mark.parametrize("text, on", [("'false'", False), ('"FALSE"', False),
                                      ('"true"', True), ("True", True), ("1", True),
                                      ("0", False), ("'yes'", True), ('"Off"', False)])
def test_booleans_written_as_text_read_as_accelerate_reads_them(text, on):
  cfg = from_yaml(ACCELERATE_FSDP.format(strategy=1)
                  .replace("fsdp_offload_params: false", f"fsdp_offload_params: {text}")
                  .replace("fsdp_activation_checkpointing: false",
                           f"fsdp_activation_checkpointing: {text}"))
  assert cfg.offload.params == ("pinned_host" if on else "device")
  assert cfg.remat.policy == ("full" if on else "none")
  reshard = from_yaml("fsdp_config:\n  fsdp_version: 2\n"
                      f"  fsdp_reshard_after_forward: {text}\n")
  assert reshard.zero.strategy == ("FULL_SHARD" if on else "SHARD_GRAD_OP")


@pytest.mark.parametrize("precision, compute", [("bf16", "bfloat16"), ("fp16", "float16"),
                                                ("no", "float32")])
def test_mixed_precision(precision, compute):
  text = ACCELERATE_FSDP.format(strategy=1).replace("mixed_precision: bf16",
                                                   f"mixed_precision: {precision}")
  cfg = from_yaml(text)
  assert cfg.precision.compute == compute
  # fp16: dynamic loss scaling with DeepSpeed's defaults, as Accelerate's GradScaler scales.
  assert cfg.precision.loss_scale == 0 and cfg.precision.initial_scale_power == 16


def test_what_the_file_leaves_out_is_accelerates_default():
  """An absent key is Accelerate's default (fp32, FULL_SHARD, no checkpointing, no
  offload), not the base config's."""
  tr = accelerate.translate({"distributed_type": "FSDP"}, config.load(TINY))
  assert tr.settings["precision.compute"] == (
      "float32", "no mixed_precision: Accelerate's default, no (fp32)")
  assert tr.settings["zero.strategy"][0] == "FULL_SHARD"
  assert tr.settings["remat.policy"][0] == "none"
  assert tr.settings["offload.optimizer"][0] == "device"


def test_offload_params_and_the_knobs_are_reported_once(tmp_path, caplog):
  text = ACCELERATE_FSDP.format(strategy="FULL_SHARD").replace(
      "fsdp_offload_params: false", "fsdp_offload_params: true")
  cfg = from_yaml(text)
  assert (cfg.offload.params, cfg.offload.optimizer) == ("pinned_host", "pinned_host")
  base = config.load(TINY)
  with caplog.at_level(logging.INFO):
    apply_file(accelerate.translate(yaml.safe_load(text), base, "fsdp.yaml"), base)
  lines = [r.getMessage() for r in caplog.records if "not needed under XLA" in r.getMessage()]
  assert len(lines) == 1 and "fsdp_config.fsdp_backward_prefetch" in lines[0]
  with pytest.raises(ConfigError, match="offloads parameters only under FULL_SHARD"):
    from_yaml(text.replace("fsdp_sharding_strategy: FULL_SHARD",
                           "fsdp_sharding_strategy: SHARD_GRAD_OP"))


def test_set_stage_and_hybrid_fix_the_strategy_the_file_names(tmp_path, capsys):
  path = tmp_path / "fsdp.yaml"
  path.write_text("distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: FULL_SHARD\n")
  where = "fsdp.yaml: fsdp_config.fsdp_sharding_strategy"
  for key, value, other in (("zero.stage", "2", "zero.hybrid=False"),
                            ("zero.hybrid", "true", "zero.stage=3")):
    assert train_cli.main(["--config", TINY, "--accelerate-config", str(path), "--set",
                           f"{key}={value}", "--print-config"]) == 0
    lines = set(capsys.readouterr().out.splitlines())
    assert {f"{key}={value.title()}  # --set", f"{other}  # {where}",
            f"zero.strategy=  # --set {key} replaces FULL_SHARD ({where})"} <= lines, lines


def test_every_key_accelerate_config_writes_is_accepted():
  """Accelerate 1.x's ClusterConfig keys (and its older dynamo_backend and fp16), as
  `accelerate config` writes them; blocks for another distributed_type are not read."""
  text = (ACCELERATE_FSDP.format(strategy="full_shard")
          + "deepspeed_config: {}\nmegatron_lm_config: {}\nmpirun_config: {}\n"
          "dynamo_backend: 'NO'\ncommands: null\ncommand_file: null\ntpu_vm: null\n")
  tr = accelerate.translate(yaml.safe_load(text), config.load(TINY))
  assert tr.settings["zero.strategy"] == ("FULL_SHARD", "fsdp_config.fsdp_sharding_strategy")
  assert {k: tr.unneeded[k] for k in ("deepspeed_config", "dynamo_backend", "tpu_vm")} == {
      "deepspeed_config": "Accelerate reads it only under distributed_type DEEPSPEED",
      "dynamo_backend": "every step is compiled by XLA", "tpu_vm": "TPU-only setting"}
  cfg = over("distributed_type: FSDP\ndeepspeed_config:\n  zero_stage: 2\n"
             "  gradient_accumulation_steps: 4\nfsdp_config:\n"
             "  fsdp_sharding_strategy: hybrid_shard_zero2\n")
  assert (cfg.zero.strategy, cfg.train.grad_accum) == ("HYBRID_SHARD_ZERO2", 2)
  tr = accelerate.translate({"distributed_type": "FSDP", "fp16": True}, config.load(TINY))
  assert tr.settings["precision.compute"] == ("float16", "fp16")
  assert over("distributed_type: FSDP\nfp16: true\nmixed_precision: bf16\n"
              ).precision.compute == "bfloat16"


def test_migrate_reads_an_accelerate_yaml(tmp_path, capsys):
  path = tmp_path / "FSDP.YAML"  # the suffix in any case
  path.write_text(ACCELERATE_FSDP.format(strategy=2))
  assert migrate.main([str(path), "--base", TINY]) == 0
  migrated = tmp_path / "migrated.py"
  migrated.write_text(capsys.readouterr().out)
  assert config.load(str(migrated)) == from_yaml(ACCELERATE_FSDP.format(strategy=2))


def test_the_parallelism_config_sizes_are_the_mesh():
  cfg = from_yaml("distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: 4\n"
                  "parallelism_config:\n  parallelism_config_dp_replicate_size: 2\n"
                  "  parallelism_config_dp_shard_size: 2\n  parallelism_config_tp_size: 2\n"
                  "  parallelism_config_cp_size: 2\n"
                  "  parallelism_config_cp_comm_strategy: alltoall\n")
  assert (cfg.zero.strategy, cfg.mesh.replica, cfg.mesh.fsdp, cfg.mesh.tensor,
          cfg.mesh.context) == ("HYBRID_SHARD", 2, 2, 2, 2)
  # torch's alltoall rotation passes key/value shards round the ring.
  assert cfg.context.strategy == "ring"


def test_fp8_mixed_precision_is_fp8_matmuls_around_bf16():
  cfg = from_yaml(ACCELERATE_FSDP.format(strategy=1).replace("mixed_precision: bf16",
                                                             "mixed_precision: fp8"))
  assert (cfg.precision.compute, cfg.precision.matmul) == ("bfloat16", "fp8")


@pytest.mark.parametrize("text, message", [
    (ACCELERATE_FSDP.format(strategy=1).replace("fsdp_forward_prefetch", "fsdp_forward_prefech"),
     "unknown key 'fsdp_config.fsdp_forward_prefech': jaxzero does not know it; did you mean "
     "'fsdp_config.fsdp_forward_prefetch'?"),
    (ACCELERATE_FSDP.format(strategy=7), "fsdp_config.fsdp_sharding_strategy=7 is not valid"),
    (ACCELERATE_FSDP.format(strategy=1).replace("mixed_precision: bf16", "mixed_precision: fp4"),
     "mixed_precision='fp4' is not valid; choose one of: no, bf16, fp16, fp8"),
    ("distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: [1\n  x: 2\n",
     "not valid YAML at line 4 column 4"),
    ("parallelism_config:\n  parallelism_config_cp_size: 3\n",
     "mesh.context=3 does not divide"),
    (ACCELERATE_FSDP.format(strategy="HYBRID_SHARD").replace("num_machines: 2",
                                                             "num_machines: two"),
     "fsdp.yaml: num_machines='two' must be an integer of at least 1"),
    (ACCELERATE_FSDP.format(strategy=1).replace("fsdp_offload_params: false",
                                                "fsdp_offload_params: maybe"),
     "fsdp.yaml: fsdp_config.fsdp_offload_params='maybe' is not valid; choose true or false"),
    (ACCELERATE_FSDP.format(strategy=1).replace("fsdp_activation_checkpointing: false",
                                                "fsdp_activation_checkpointing: 2"),
     "fsdp_config.fsdp_activation_checkpointing=2 is not valid; choose true or false"),
])
def test_bad_accelerate_config_is_one_line_and_exit_code_2(text, message, tmp_path, capsys):
  path = tmp_path / "fsdp.yaml"
  path.write_text(text)
  code = train_cli.main(["--config", TINY, "--accelerate-config", str(path),
                         "--workdir", str(tmp_path / "w")])
  errors = capsys.readouterr().err.strip().splitlines()
  assert code == 2 and len(errors) == 1 and message in errors[0], errors
  assert not (tmp_path / "w").exists()


def over(text: str, base_path: str = TINY) -> config.Config:
  base = config.load(base_path)
  result = accelerate.translate(yaml.safe_load(text), base).apply(base)
  config.validate(result)
  return result


def test_files_read_as_accelerate_and_fsdp_run_them():
  """What each file means to Accelerate 1.15 and torch's FSDP."""
  # HSDP from ParallelismConfig: shard 4 ways, replicate across 2 (FSDP2's 2-D mesh).
  hsdp = ("distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n"
          "  fsdp_reshard_after_forward: {}\nparallelism_config:\n"
          "  parallelism_config_dp_replicate_size: 2\n  parallelism_config_dp_shard_size: 4\n")
  cfg = over(hsdp.format("true"))
  assert (cfg.zero.strategy, cfg.mesh.replica, cfg.mesh.fsdp) == ("HYBRID_SHARD", 2, 4)
  assert over(hsdp.format("false")).zero.strategy == "HYBRID_SHARD_ZERO2"
  # MixedPrecision(param_dtype, reduce_dtype) in the run's dtype; gradients in the fp32 shards'.
  llama8b = "configs/llama8b_zero3.py"  # (its own grads are bfloat16)
  cfg = over("distributed_type: FSDP\nmixed_precision: BF16\n", llama8b)
  assert (cfg.precision.compute, cfg.zero.grad_dtype, cfg.zero.reduce_dtype) == (
      "bfloat16", "float32", "bfloat16")
  cfg = over("distributed_type: FSDP\nmixed_precision: 'no'\n", llama8b)
  assert (cfg.precision.compute, cfg.zero.grad_dtype, cfg.zero.reduce_dtype) == (
      "float32", "float32", "float32")
  # DDP under autocast: fp32 weights, gradients and reduction.
  cfg = over("distributed_type: MULTI_GPU\nmixed_precision: bf16\n")
  assert (cfg.zero.strategy, cfg.zero.grad_dtype, cfg.zero.reduce_dtype) == (
      "NO_SHARD", "float32", "float32")
  # FSDP1's SHARD_GRAD_OP over replicas is HYBRID_SHARD_ZERO2; a shard size left to the
  # device count shards inside each replica too (HSDP); DDP's replicas are not HSDP.
  cfg = over("distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: SHARD_GRAD_OP\n"
             "parallelism_config:\n  parallelism_config_dp_replicate_size: 2\n"
             "  parallelism_config_dp_shard_size: 4\n")
  assert cfg.zero.strategy == "HYBRID_SHARD_ZERO2"
  cfg = over("distributed_type: FSDP\nparallelism_config:\n"
             "  parallelism_config_dp_replicate_size: 2\n")
  assert (cfg.zero.strategy, cfg.mesh.replica, cfg.mesh.fsdp) == ("HYBRID_SHARD", 2, -1)
  assert mesh_lib.resolve_shape(cfg.mesh, 8)[:2] == (2, 4)
  assert over("distributed_type: MULTI_GPU\nparallelism_config:\n"
              "  parallelism_config_dp_replicate_size: 8\n").zero.strategy == "NO_SHARD"
  # No parallelism_config: Accelerate runs neither tensor nor context parallelism.
  cfg = over("distributed_type: FSDP\n", "configs/llama8b_128k.py")
  assert (cfg.mesh.context, cfg.mesh.tensor, cfg.mesh.replica, cfg.mesh.fsdp) == (1, 1, 1, -1)
  # fp16: torch's GradScaler (2**16, doubled after 2000 good steps, halved at each overflow).
  cfg = over("distributed_type: FSDP\nmixed_precision: fp16\n")
  assert (cfg.precision.loss_scale, cfg.precision.initial_scale_power,
          cfg.precision.loss_scale_window, cfg.precision.hysteresis) == (0.0, 16, 2000, 1)
  # DDP reads no fsdp_config, offload or not.
  cfg = over("distributed_type: MULTI_GPU\nfsdp_config:\n  fsdp_offload_params: true\n"
             "  fsdp_reshard_after_forward: FULL_SHARD\n")
  assert (cfg.zero.strategy, cfg.offload.params) == ("NO_SHARD", "device")
  # A size ParallelismConfig leaves out is 1: the base's context 8 does not survive.
  cfg = over("distributed_type: FSDP\nparallelism_config:\n"
             "  parallelism_config_dp_shard_size: 8\n", "configs/llama8b_128k.py")
  assert (cfg.mesh.fsdp, cfg.mesh.context, cfg.mesh.tensor) == (8, 1, 1)
  # FSDP2 reads fsdp_reshard_after_forward alone, as a boolean.
  cfg = over("distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n"
             "  fsdp_sharding_strategy: SHARD_GRAD_OP\n")
  assert cfg.zero.strategy == "FULL_SHARD"
  with pytest.raises(ConfigError, match="under fsdp_version 2 is not valid; choose true"):
    over("distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n"
         "  fsdp_reshard_after_forward: SHARD_GRAD_OP\n")
  # What `accelerate config` writes for fp8, and checkpointing with offload.
  cfg = over("distributed_type: FSDP\nmixed_precision: fp8\nfp8_config:\n  backend: TE\n"
             "fsdp_config:\n  fsdp_activation_checkpointing: true\n"
             "  fsdp_activation_checkpointing_offload: true\n")
  assert (cfg.precision.matmul, cfg.remat.policy) == ("fp8", "offload_matmuls")
  with pytest.raises(ConfigError, match="fsdp_ignored_modules: every weight is sharded"):
    over("distributed_type: FSDP\nfsdp_config:\n  fsdp_ignored_modules: [lm_head]\n")
  with pytest.raises(ConfigError, match="pass its deepspeed_config_file"):
    over("distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: ds.json\n")


def test_print_config_names_the_key_that_set_the_strategy():
  tr = accelerate.translate(yaml.safe_load(
      "distributed_type: FSDP\nfsdp_config:\n  fsdp_reshard_after_forward: SHARD_GRAD_OP\n"),
      config.load(TINY))
  assert tr.settings["zero.strategy"] == ("SHARD_GRAD_OP",
                                          "fsdp_config.fsdp_reshard_after_forward")
  assert tr.settings["precision.matmul"][0] == "default"  # not a base's fp8
