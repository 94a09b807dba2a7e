"""What a plan plans: its rows (every stage, remat policy or offload setting, as
jaxzero.train would accept them), and the config as compiled on virtual CPU devices (a
batch split that divides them, attention XLA:CPU can lower)."""

from __future__ import annotations

import dataclasses

import jax

from jaxzero import config as config_lib
from jaxzero.config import Config
from jaxzero.engine.remat import POLICY_NAMES
from jaxzero.errors import ConfigError

SWEEPS = ("stages", "remat", "offload")


@dataclasses.dataclass(frozen=True)
class Variant:
  """One row of a plan: where the state lives and how activations are kept."""
  stage: int
  hybrid: bool
  remat: str
  offload_optimizer: str = "device"
  offload_params: str = "device"

  @property
  def strategy(self) -> str:
    return config_lib.strategy_name(self.stage, self.hybrid)

  def apply(self, cfg: Config) -> Config:
    offload = dataclasses.replace(cfg.offload, optimizer=self.offload_optimizer,
                                  params=self.offload_params)
    if self.offload_optimizer != "pinned_host":  # DPU and Twin-Flow are the host update's
      offload = dataclasses.replace(offload, delayed_update=False, optimizer_fraction=1.0)
    return dataclasses.replace(
        cfg, zero=dataclasses.replace(cfg.zero, stage=self.stage, strategy="", hybrid=self.hybrid),
        remat=dataclasses.replace(cfg.remat, policy=self.remat), offload=offload)


def variants(cfg: Config, sweep: str, replica: int) -> list[Variant]:
  """The rows of a plan: every stage, every remat policy, or every offload setting."""
  stage, hybrid = cfg.zero.resolved
  policy, offload = cfg.remat.policy, cfg.offload
  if sweep == "stages":
    rows = [Variant(s, False, policy, offload.optimizer, offload.params if s == 3 else "device")
            for s in range(4)]
    if replica > 1:
      rows += [Variant(3, True, policy, offload.optimizer, offload.params),
               Variant(2, True, policy, offload.optimizer)]
    return rows
  if sweep == "remat":
    return [Variant(stage, hybrid, name, offload.optimizer, offload.params)
            for name in POLICY_NAMES]
  if sweep == "offload":
    if cfg.lora.rank:  # the adapters' state stays; the frozen base may rest on the host
      if stage != 3:
        raise ConfigError(f"--sweep offload with lora.rank at zero.stage={stage}: a LoRA "
                          "run's one offload is its frozen base's (offload.params=pinned_host),"
                          " at stage 3; set zero.stage=3")
      return [Variant(stage, hybrid, policy, "device", params)
              for params in ("device", "pinned_host")]
    kinds = [("device", "device"), ("pinned_host", "device")]
    if stage == 3:
      kinds += [("device", "pinned_host"), ("pinned_host", "pinned_host")]
    return [Variant(stage, hybrid, policy, opt, params) for opt, params in kinds]
  raise ValueError(f"sweep={sweep!r}; choose one of: {', '.join(SWEEPS)}")


def name(v: Variant) -> str:
  return (f"{v.strategy} with remat.policy={v.remat}, offload.optimizer={v.offload_optimizer},"
          f" offload.params={v.offload_params}")


def fit_batch_arithmetic(cfg: Config, n_data_parallel: int) -> tuple[Config, list[str]]:
  """`cfg` with a grad_accum that splits train.global_batch over the devices.

  A preset written for 8 devices (global_batch 64 = micro 1 x 8 x grad_accum
  8) does not divide 64 devices. Planning keeps global_batch and takes the
  largest grad_accum up to the configured one that divides it, as one would
  when moving to more devices; the plan says so.
  """
  t = cfg.train
  least = cfg.mesh.pipeline  # a pipeline's stages need a micro-batch each at least
  for accum in range(t.grad_accum, least - 1, -1):
    if t.global_batch % (n_data_parallel * accum) == 0:
      break
  else:
    raise ConfigError(f"train.global_batch={t.global_batch} cannot be split over "
                      f"{n_data_parallel} data-parallel devices"
                      + (f" in at least mesh.pipeline={least} micro-batches" if least > 1 else "")
                      + f"; use a multiple of {n_data_parallel * least} "
                      "(--set train.global_batch=...)")
  if accum == t.grad_accum:
    return cfg, []
  note = (f"train.grad_accum {t.grad_accum} -> {accum} so that global_batch {t.global_batch} "
          f"= micro-batch {t.global_batch // (n_data_parallel * accum)} x {n_data_parallel} "
          f"devices x {accum}")
  return dataclasses.replace(cfg, train=dataclasses.replace(t, grad_accum=accum)), [note]


def for_cpu(cfg: Config) -> tuple[Config, list[str]]:
  """`cfg` as compiled on virtual CPU devices, and what the plan says of it: cuDNN's
  attention (asked for, or what "auto" resolves to on a GPU machine) XLA:CPU cannot
  lower, so it is planned as what XLA:CPU runs ("blockwise": flash attention's memory,
  block by block, as cuDNN's)."""
  attention = getattr(cfg.model, "attention", None)
  if attention != "cudnn" and (attention != "auto" or jax.default_backend() == "cpu"):
    return cfg, []
  notes = (["model.attention=cudnn is planned as blockwise attention (XLA:CPU has no cuDNN; "
            "both keep no T x T scores)"] if attention == "cudnn" else [])
  return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model,
                                                            attention="blockwise")), notes


def cpu_devices(n: int) -> list:
  devices = jax.devices("cpu")
  if n > len(devices):
    raise ConfigError(f"planning for {n} devices needs {n} virtual CPU devices, but JAX started "
                      f"with {len(devices)}; run jaxzero.plan in a fresh process")
  return devices[:n]
