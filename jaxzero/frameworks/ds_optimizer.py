"""A ds_config's ``optimizer`` and ``scheduler`` blocks as ``train.*`` settings.

Adam and AdamW (``adam_w_mode`` as DeepSpeed reads it) with DeepSpeed's defaults for what
the block leaves out; WarmupLR, WarmupDecayLR and WarmupCosineLR as jaxzero's schedules of
the same shape (jaxzero.engine.schedules). ``"auto"`` takes the base config's value.
"""

from __future__ import annotations

from jaxzero import config as config_lib
from jaxzero.frameworks.translated_file import Translation, number, param


def translate(tr: Translation, ds: dict, base: config_lib.Config) -> None:
  """Adds the settings of `ds`'s ``optimizer`` and ``scheduler`` blocks to `tr`."""
  lr = _optimizer(tr, ds["optimizer"], base) if "optimizer" in ds else base.train.lr
  if "scheduler" in ds:
    _scheduler(tr, ds["scheduler"], base, lr)


def _optimizer(tr: Translation, block: dict, base: config_lib.Config) -> float:
  """Translates the optimizer block; returns its learning rate."""
  tr.check_keys(block, "optimizer.", {"type", "params", "legacy_fusion"})
  if "legacy_fusion" in block:
    tr.unneeded["optimizer.legacy_fusion"] = "the update is one fused XLA computation"
  kind = str(block.get("type", "")).lower()  # DeepSpeed matches optimizer names this way
  if kind not in ("adam", "adamw"):
    raise tr.error(f"optimizer.type={block.get('type')!r} is not available; jaxzero trains "
                   f"with AdamW or Adam")
  where = "optimizer.params."
  if isinstance(block.get("params"), dict) and "max_grad_norm" in block["params"]:
    raise tr.error(f"{where}max_grad_norm: DeepSpeed refuses it as an optimizer parameter; "
                   "set gradient_clipping (train.clip_norm) instead")
  params = tr.check_keys(block.get("params", {}), where,
                         {"lr", "betas", "eps", "weight_decay", "torch_adam", "adam_w_mode",
                          "bias_correction", "amsgrad"})
  if params.get("bias_correction", True) is not True or params.get("amsgrad", False):
    raise tr.error(f"{where}bias_correction=false and amsgrad=true are not available")
  if "torch_adam" in params:
    tr.unneeded[where + "torch_adam"] = "the update is one fused XLA computation either way"
  # As DeepSpeed: the name AdamW, or adam_w_mode (default true), means decoupled decay.
  decoupled = kind == "adamw" or params.get("adam_w_mode", True) is not False
  tr.set("train.optimizer", "adamw" if decoupled else "adam", "optimizer.type / adam_w_mode")
  # DeepSpeed's defaults: FusedAdam and CPU Adam decay 0; torch.optim.AdamW 0.01.
  decay = 0.01 if params.get("torch_adam") and decoupled else 0.0
  t = base.train
  betas = params.get("betas", [0.9, 0.999])
  if betas == "auto":
    tr.autos.add(where + "betas")
    betas = [t.b1, t.b2]
  if not isinstance(betas, list) or len(betas) != 2:
    raise tr.error(f"{where}betas={betas!r} must be a list of two numbers")
  lr = param(tr, params, where, "lr", t.lr, 1e-3, minimum=0)
  for key, value in (("lr", lr), ("b1", number(tr, betas[0], where + "betas", minimum=0)),
                     ("b2", number(tr, betas[1], where + "betas", minimum=0)),
                     ("eps", param(tr, params, where, "eps", t.eps, 1e-8, minimum=0)),
                     ("weight_decay", param(tr, params, where, "weight_decay",
                                             t.weight_decay, decay, minimum=0))):
    origin = where + ("betas" if key in ("b1", "b2") else key)
    tr.set(f"train.{key}", value, origin)
  return lr


SCHEDULES = {"WarmupLR": "warmup_constant", "WarmupDecayLR": "warmup_linear_decay",
             "WarmupCosineLR": "warmup_cosine_ds"}


def _scheduler(tr: Translation, block: dict, base: config_lib.Config, lr: float) -> None:
  tr.check_keys(block, "scheduler.", {"type", "params"})
  kind = block.get("type")
  if not isinstance(kind, str) or kind not in SCHEDULES:
    raise tr.error(f"scheduler.type={kind!r} is not available; choose one of: "
                   + ", ".join(SCHEDULES))
  where, t = "scheduler.params.", base.train
  known = {"warmup_num_steps", "warmup_type", "last_batch_iteration", "total_num_steps"}
  known |= ({"warmup_min_ratio", "cos_min_ratio"} if kind == "WarmupCosineLR"
            else {"warmup_min_lr", "warmup_max_lr"})
  if kind == "WarmupLR":
    known.remove("total_num_steps")
  params = tr.check_keys(block.get("params", {}), where, known)
  if params.get("last_batch_iteration", -1) != -1:
    raise tr.error(f"{where}last_batch_iteration: a run resumes its schedule from its "
                   f"checkpoint's step; leave it at -1")
  tr.set("train.schedule", SCHEDULES[kind], "scheduler.type")
  warmup_type = params.get("warmup_type", "log")
  if warmup_type == "auto":
    warmup_type = t.warmup_type
  if warmup_type not in ("log", "linear"):
    raise tr.error(f"{where}warmup_type={warmup_type!r} is not valid; choose one of: log, linear")
  tr.set("train.warmup_type", warmup_type, where + "warmup_type")
  warmup = param(tr, params, where, "warmup_num_steps", t.warmup_steps, 1000, int, 1)
  tr.set("train.warmup_steps", warmup, where + "warmup_num_steps")
  if kind != "WarmupLR":
    if "total_num_steps" not in params:
      raise tr.error(f"{where}total_num_steps is required by {kind}")
    tr.set("train.steps", param(tr, params, where, "total_num_steps", t.steps, None, int, 1),
           where + "total_num_steps")
  if kind == "WarmupCosineLR":  # ratios of the optimizer's lr
    tr.set("train.warmup_min_ratio", param(tr, params, where, "warmup_min_ratio",
                                            t.warmup_min_ratio, 0.0, minimum=0),
           where + "warmup_min_ratio")
    tr.set("train.min_lr_ratio", param(tr, params, where, "cos_min_ratio", t.min_lr_ratio,
                                        1e-4, minimum=0), where + "cos_min_ratio")
    return
  # WarmupLR's peak defaults to the optimizer's lr, WarmupDecayLR's to 0.001; "auto" (the
  # HF Trainer's) is the run's learning rate, the optimizer's.
  max_lr = param(tr, params, where, "warmup_max_lr", lr,
                  lr if kind == "WarmupLR" else 1e-3, minimum=0)
  min_lr = param(tr, params, where, "warmup_min_lr", t.warmup_min_ratio * max_lr, 0.0,
                  minimum=0)
  peak = (where + "warmup_max_lr" if "warmup_max_lr" in params else
          f"no {where}warmup_max_lr: WarmupLR's default, the optimizer's lr" if kind == "WarmupLR"
          else f"no {where}warmup_max_lr: WarmupDecayLR's default, 0.001")
  tr.set("train.lr", max_lr, peak)
  tr.set("train.warmup_min_ratio", min_lr / max_lr if max_lr else 0.0,
         where + "warmup_min_lr / warmup_max_lr")
