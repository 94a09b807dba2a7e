"""`--deepspeed ds_config.json`: realistic configs map field by field, DeepSpeed's
schedules match its formulas, a ds_config run equals the `--set` run, migrate's
output resolves to the same config, and bad input is one line with exit code 2."""

import argparse
import dataclasses
import json
import logging
import math
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxzero import cli, config
from jaxzero import engine as engine_lib
from jaxzero import migrate
from jaxzero import train as train_cli
from jaxzero.errors import ConfigError
from jaxzero.frameworks import deepspeed
from jaxzero.frameworks.translated_file import apply_file, read_mapping
from jaxzero.parallel import mesh as mesh_lib
from jaxzero.training import loop

from processes import TINY, run_python

# Bucket and prefetch knobs as a Llama ds_config carries them.
XLA_KNOBS = {"overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": 5e8,
             "allgather_bucket_size": 5e8, "round_robin_gradients": True}
STAGE3_KNOBS = {"stage3_prefetch_bucket_size": 5e8, "stage3_param_persistence_threshold": 1e6,
                "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                "stage3_gather_16bit_weights_on_model_save": True, "sub_group_size": 1e9}


def base():
  return config.load(TINY)  # mesh 1 x 8, global_batch 32, grad_accum 2, lr 3e-3, stage 3


def from_ds(ds: dict, cfg=None, devices: int = 8, from_set=()) -> config.Config:
  """The config `ds` means over `cfg`, its batch sizes resolved on `devices`."""
  cfg = cfg or base()
  tr = deepspeed.translate(ds, cfg)
  result, _ = deepspeed.resolve_batch(tr.apply(cfg), tr, devices, from_set)
  config.validate(result)
  return result


def assert_fields(cfg, **expected):
  for key, value in expected.items():
    section, field = key.split("__")
    assert getattr(getattr(cfg, section), field) == value, key


def test_zero1_adamw_warmup_lr():
  cfg = from_ds({
      "train_batch_size": 64, "train_micro_batch_size_per_gpu": 4,
      "gradient_accumulation_steps": 2, "gradient_clipping": 0.5, "steps_per_print": 20,
      "bf16": {"enabled": True},
      "optimizer": {"type": "AdamW",
                    "params": {"lr": 1e-4, "betas": [0.9, 0.98], "eps": 1e-6,
                               "weight_decay": 0.05}},
      "scheduler": {"type": "WarmupLR",
                    "params": {"warmup_min_lr": 1e-5, "warmup_max_lr": 2e-4,
                               "warmup_num_steps": 100, "warmup_type": "linear"}},
      "zero_optimization": {"stage": 1, **XLA_KNOBS},
  })
  assert_fields(cfg, zero__stage=1, zero__strategy="", train__global_batch=64,
                train__grad_accum=2, train__clip_norm=0.5, train__log_every=5,  # the base's
                precision__compute="bfloat16", train__optimizer="adamw", train__b1=0.9,
                train__b2=0.98, train__eps=1e-6, train__weight_decay=0.05,
                train__schedule="warmup_constant", train__lr=2e-4, train__warmup_steps=100,
                train__warmup_type="linear", offload__optimizer="device")
  assert cfg.train.warmup_min_ratio == pytest.approx(0.05, rel=1e-12)
  assert cfg.train.steps == base().train.steps  # WarmupLR has no length: the base's


def test_zero2_adam_l2_warmup_decay_lr():
  cfg = from_ds({
      "train_batch_size": 32, "gradient_accumulation_steps": 4,
      "optimizer": {"type": "Adam", "params": {"lr": 3e-4, "weight_decay": 0.01,
                                               "adam_w_mode": False}},
      "scheduler": {"type": "WarmupDecayLR",
                    "params": {"total_num_steps": 500, "warmup_num_steps": 20}},
      "zero_optimization": {"stage": 2, **XLA_KNOBS, "reduce_scatter": True},
  })
  # Left-out parameters take DeepSpeed's defaults: betas (0.9, 0.999), eps 1e-8,
  # WarmupDecayLR's warmup_max_lr 0.001, warmup_min_lr 0 and log warmup.
  assert_fields(cfg, zero__stage=2, train__global_batch=32, train__grad_accum=4,
                train__optimizer="adam", train__b1=0.9, train__b2=0.999, train__eps=1e-8,
                train__weight_decay=0.01, train__schedule="warmup_linear_decay",
                train__lr=1e-3, train__warmup_min_ratio=0.0, train__warmup_steps=20,
                train__steps=500, train__warmup_type="log")
  # No bf16 or fp16 block: DeepSpeed trains in fp32, and so does the translation.
  assert cfg.precision.compute == "float32"
  tr = deepspeed.translate({"zero_optimization": {"stage": 2}}, base())
  assert tr.settings["precision.compute"] == (
      "float32", "no bf16 or fp16 block: DeepSpeed trains in fp32")
  # An explicit "auto" (the HF Trainer's) keeps the base's, as before.
  assert from_ds({"bf16": {"enabled": "auto"}}).precision == base().precision
  assert from_ds({"fp16": {"enabled": False}}).precision.compute == "float32"
  assert from_ds({"bf16": {}}).precision.compute == "float32"  # enabled absent: false


def test_what_the_file_leaves_out_is_deepspeeds_default():
  """An absent key governs as DeepSpeed's default does, not as the base config's."""
  cfg = base()
  assert (cfg.train.clip_norm, cfg.zero.stage) != (0.0, 0)  # the base clips and shards
  tr = deepspeed.translate({"bf16": {"enabled": True}}, cfg)
  assert tr.settings["train.clip_norm"] == (
      1.0, "no gradient_clipping: DeepSpeed's default clips at 1.0")  # its constants.py
  assert tr.settings["zero.stage"] == (0, "no zero_optimization.stage: DeepSpeed's default, 0")
  # DeepSpeed accumulates and reduces gradients in the training dtype (engine.get_data_types).
  assert tr.settings["zero.grad_dtype"][0] == "bfloat16"
  assert tr.settings["zero.reduce_dtype"][0] == "bfloat16"
  assert tr.settings["offload.optimizer"] == (
      "device", "no zero_optimization.offload_optimizer: DeepSpeed's default, none")
  assert "train.nonfinite" not in tr.settings  # stage 0 applies the step: the base's stands
  cfg = from_ds({"bf16": {"enabled": True}, "communication_data_type": "fp32",
                 "data_types": {"grad_accum_dtype": "fp32"}, "gradient_clipping": 0.5,
                 "zero_optimization": {"stage": 3}})
  assert_fields(cfg, zero__grad_dtype="float32", zero__reduce_dtype="float32",
                train__clip_norm=0.5, zero__stage=3)
  # A ZeRO optimizer skips a step whose gradient norm is not finite; bf16 at stages 1-2
  # only with check_grad_overflow (stage_1_and_2.py, stage3.py).
  for stage, check, nonfinite in ((2, True, "skip"), (2, False, base().train.nonfinite),
                                  (3, False, "skip")):
    cfg = from_ds({"bf16": {"enabled": True, "check_grad_overflow": check},
                   "zero_optimization": {"stage": stage}})
    assert cfg.train.nonfinite == nonfinite, (stage, check)
  # The offloading base (pinned_host) offloads nothing under a file that says nothing of it.
  offloaded = dataclasses.replace(base(), offload=config.OffloadConfig(optimizer="pinned_host"))
  assert from_ds({"zero_optimization": {"stage": 2}}, offloaded).offload.optimizer == "device"
  # Without an optimizer or scheduler block DeepSpeed uses the script's: the base's.
  cfg = from_ds({})
  assert (cfg.train.optimizer, cfg.train.lr, cfg.train.schedule) == (
      base().train.optimizer, base().train.lr, base().train.schedule)


def test_zero3_cpu_optimizer_offload_warmup_cosine_lr():
  ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 8,
        "bf16": {"enabled": True}, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-4, "betas": [0.9, 0.95],
                                                  "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupCosineLR",
                      "params": {"total_num_steps": 2000, "warmup_num_steps": 100,
                                 "warmup_min_ratio": 0.01, "cos_min_ratio": 0.1}},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu",
                                                                "pin_memory": True},
                              **XLA_KNOBS, **STAGE3_KNOBS},
        "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True}}
  # The model checkpoints its layers (the base's remat.policy): cpu_checkpointing moves that.
  cfg = from_ds(ds, dataclasses.replace(base(), remat=config.RematConfig(policy="full")))
  assert_fields(cfg, zero__stage=3, offload__optimizer="pinned_host", offload__params="device",
                train__global_batch=64, train__grad_accum=8, precision__compute="bfloat16",
                train__lr=2e-4, train__b2=0.95, train__weight_decay=0.1,
                train__schedule="warmup_cosine_ds", train__steps=2000,
                train__warmup_steps=100, train__warmup_min_ratio=0.01,
                train__min_lr_ratio=0.1, remat__policy="offload_matmuls")
  tr = deepspeed.translate(ds, base())
  assert "zero_optimization.overlap_comm" in tr.unneeded
  assert "zero_optimization.stage3_max_live_parameters" in tr.unneeded


def test_param_persistence_threshold_is_the_min_shard_size():
  """DeepSpeed keeps a parameter of at most the threshold's elements whole (numel <=
  threshold); jaxzero one under zero.min_shard_size."""
  knobs = {"stage": 3, "stage3_param_persistence_threshold": 1e6}
  assert from_ds({"zero_optimization": knobs}).zero.min_shard_size == 1_000_001
  auto = {"stage": 3, "stage3_param_persistence_threshold": "auto"}  # the HF Trainer's
  assert from_ds({"zero_optimization": auto}).zero.min_shard_size == base().zero.min_shard_size
  tr = deepspeed.translate({"zero_optimization": knobs}, base())
  assert "zero_optimization.stage3_param_persistence_threshold" not in tr.unneeded
  with pytest.raises(ConfigError, match="stage3_param_persistence_threshold=-1 must be an "
                                        "integer of at least 0"):
    from_ds({"zero_optimization": {"stage3_param_persistence_threshold": -1}})


def test_zero3_param_offload_and_the_knobs_are_reported_once(caplog):
  ds = {"train_batch_size": 16, "zero_optimization": {
      "stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
      "offload_optimizer": {"device": "cpu"}, **STAGE3_KNOBS}}
  with caplog.at_level(logging.INFO):
    tr = deepspeed.translate(ds, base(), "ds.json")
    cfg, _ = deepspeed.resolve_batch(apply_file(tr, base()), tr, 8)
  # One batch size alone: DeepSpeed's rule accumulates nothing.
  assert_fields(cfg, offload__params="pinned_host", offload__optimizer="pinned_host",
                train__global_batch=16, train__grad_accum=1)
  lines = [r.getMessage() for r in caplog.records if "not needed under XLA" in r.getMessage()]
  assert len(lines) == 1 and "stage3_prefetch_bucket_size" in lines[0]
  assert "layer scan" in lines[0]  # what jaxzero does instead
  with pytest.raises(ConfigError, match="offload_param needs stage 3"):
    from_ds({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})


def test_nvme_optimizer_offload_is_the_nvme_tier(tmp_path):
  offload = {"device": "nvme", "nvme_path": str(tmp_path), "pin_memory": True,
             "buffer_count": 4, "pipeline_read": True, "fast_init": False}
  ds = {"zero_optimization": {"stage": 2, "offload_optimizer": offload},
        "aio": {"block_size": 1048576, "queue_depth": 8}}
  cfg = from_ds(ds)
  assert_fields(cfg, zero__stage=2, offload__optimizer="nvme", offload__nvme_dir=str(tmp_path),
                offload__params="device")
  tr = deepspeed.translate(ds, base())
  assert {"zero_optimization.offload_optimizer.buffer_count", "aio"} <= set(tr.unneeded)
  assert "zero_optimization.offload_optimizer.nvme_path" not in tr.unneeded
  # DeepSpeed's nvme_path is required there too; parameters on NVMe need the optimizer
  # state there, in the same directory, at stage 3.
  nvme = {"device": "nvme", "nvme_path": str(tmp_path)}
  for block, message in (
      ({"offload_optimizer": {"device": "nvme"}},
       "ds_config: zero_optimization.offload_optimizer.device=nvme needs "
       "zero_optimization.offload_optimizer.nvme_path, a directory on local disk"),
      ({"stage": 3, "offload_param": nvme},
       "ds_config: zero_optimization.offload_param.device=nvme needs offload_optimizer.device="
       "nvme too: the parameter tier reads the master weights from its files"),
      ({"stage": 2, "offload_param": nvme, "offload_optimizer": nvme},
       "ds_config: zero_optimization.offload_param needs stage 3 (parameters are sharded and "
       "offloaded only under ZeRO-3)"),
      ({"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/elsewhere"},
        "offload_optimizer": nvme},
       "ds_config: zero_optimization.offload_param.nvme_path='/elsewhere' differs from "
       f"zero_optimization.offload_optimizer.nvme_path={str(tmp_path)!r}: the parameters, "
       "gradients and optimizer state share one directory here (offload.nvme_dir); give both "
       "the same path")):
    with pytest.raises(ConfigError) as e:
      from_ds({"zero_optimization": block})
    assert str(e.value) == message


def test_a_partial_optimizer_offload_is_twin_flow_at_stage_3():
  """offload_optimizer.ratio: DeepSpeed's partial offload (ZeRO-Offload++), the share of
  the optimizer state in CPU memory, only at stage 3 (its config asserts it)."""
  cfg = from_ds({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu",
                                                                          "ratio": 0.3}}})
  assert (cfg.offload.optimizer, cfg.offload.optimizer_fraction) == ("pinned_host", 0.3)
  where = "ds_config: zero_optimization.offload_optimizer.ratio"
  for block, message in (
      ({"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.3}},
       f"{where}=0.3 (partial offload) applies to offload_optimizer with device cpu at "
       "stage 3, as in DeepSpeed"),
      ({"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 1.5}},
       f"{where}=1.5 must be a number from 0 to 1")):
    with pytest.raises(ConfigError) as e:
      from_ds({"zero_optimization": block})
    assert str(e.value) == message


def test_zero_infinity_puts_parameters_gradients_and_optimizer_on_nvme(tmp_path):
  # DeepSpeed's ZeRO-Infinity block as its docs give it: both on NVMe, with buffer knobs.
  nvme = {"device": "nvme", "nvme_path": str(tmp_path), "pin_memory": True}
  ds = {"zero_optimization": {
      "stage": 3, "offload_optimizer": {**nvme, "buffer_count": 4, "fast_init": False},
      "offload_param": {**nvme, "buffer_count": 5, "buffer_size": 1e8, "max_in_cpu": 1e9}},
      "aio": {"block_size": 1048576, "queue_depth": 8}}
  cfg = from_ds(ds)
  assert_fields(cfg, zero__stage=3, offload__optimizer="nvme", offload__params="nvme",
                offload__nvme_dir=str(tmp_path))
  unneeded = deepspeed.translate(ds, base()).unneeded
  assert "none kept in RAM" in unneeded["zero_optimization.offload_param.max_in_cpu"]
  assert "one layer is read ahead" in unneeded["zero_optimization.offload_param.buffer_count"]
  assert "chunks" in unneeded["zero_optimization.offload_param.buffer_size"]
  assert {"zero_optimization.offload_param.pin_memory", "aio",
          "zero_optimization.offload_optimizer.buffer_count"} <= set(unneeded)


def test_names_and_paths_are_read_as_deepspeed_reads_them(tmp_path):
  """communication_data_type in any case; grad_accum_dtype by DtypeEnum's names; one
  NVMe directory written with or without its trailing slash; no NaN clipping."""
  cfg = from_ds({"communication_data_type": "BF16", "data_types": {"grad_accum_dtype": "float"}})
  assert (cfg.zero.reduce_dtype, cfg.zero.grad_dtype) == ("bfloat16", "float32")
  for name, dtype in (("torch.bfloat16", "bfloat16"), ("half", "float16"), ("fp32", "float32")):
    assert from_ds({"data_types": {"grad_accum_dtype": name}}).zero.grad_dtype == dtype
  with pytest.raises(ConfigError) as e:
    from_ds({"data_types": {"grad_accum_dtype": "int8"}})
  assert str(e.value) == ("ds_config: data_types.grad_accum_dtype='int8' is not available; "
                          "choose one of: fp32, bf16, fp16 (or float32, float, torch.float32, "
                          "bfloat16, torch.bfloat16, float16, half, torch.float16)")
  cfg = from_ds({"zero_optimization": {
      "stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": f"{tmp_path}/"},
      "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}}})
  assert cfg.offload.params == "nvme"
  with pytest.raises(ConfigError) as e:
    deepspeed.translate(json.loads('{"gradient_clipping": NaN}'), base())
  assert str(e.value) == "ds_config: gradient_clipping=nan must be a finite number of at least 0"


def test_data_types_module_casts_are_checked_as_deepspeed_checks_them():
  """param_dtype must be the training dtype (DeepSpeed's engine asserts it); buffer_dtype
  and keep_in_fp32_modules are read and have nothing to act on."""
  data_types = {"param_dtype": "bf16", "buffer_dtype": "torch.float32",
                "keep_in_fp32_modules": ["rotary_emb"]}
  tr = deepspeed.translate({"bf16": {"enabled": True}, "data_types": data_types}, base())
  assert {f"data_types.{k}" for k in data_types} <= set(tr.unneeded)
  assert from_ds({"data_types": {"param_dtype": "float"}}).precision.compute == "float32"
  for data_types, message in (
      ({"param_dtype": "fp16"}, "data_types.param_dtype='fp16' conflicts with the training "
       "dtype, float32 (the fp16/bf16 blocks); match it or leave param_dtype out"),
      ({"buffer_dtype": "int4"}, "data_types.buffer_dtype='int4' is not available; choose"),
      ({"keep_in_fp32_modules": "norm"}, "data_types.keep_in_fp32_modules='norm' must be "
       "\"auto\" or a list of name patterns")):
    with pytest.raises(ConfigError, match="^ds_config: " + re.escape(message)):
      from_ds({"data_types": data_types})


def test_tensor_parallel_and_pipeline_blocks_are_the_mesh_axes():
  ds = {"tensor_parallel": {"autotp_size": 2, "tp_overlap_comm": True},
        "pipeline": {"stages": 2, "partition": "parameters", "activation_checkpoint_interval": 1,
                     "pipe_partitioned": True, "grad_partitioned": True},
        "train_batch_size": 32, "gradient_accumulation_steps": 2}
  cfg = from_ds(ds, devices=8)
  # The data-parallel group is what is left, as in DeepSpeed: 8 / (2 x 2).
  assert (cfg.mesh.tensor, cfg.mesh.pipeline, cfg.mesh.fsdp) == (2, 2, -1)
  assert cfg.pipeline.schedule == "1f1b"  # DeepSpeed's pipeline engine's
  assert mesh_lib.resolve_shape(cfg.mesh, 8) == (1, 2, 2)
  unneeded = deepspeed.translate(ds, base()).unneeded
  assert {"tensor_parallel.tp_overlap_comm", "pipeline.partition",
          "pipeline.activation_checkpoint_interval"} <= set(unneeded)
  # DeepSpeed's default "auto" stages (its PipelineModule's num_stages) keep the base's.
  assert from_ds({"pipeline": {"stages": "auto"}}).mesh.pipeline == 1


def test_ulysses_sequence_parallel_size_is_the_context_axis():
  ds = {"sequence_parallel_size": 4, "train_batch_size": 8, "gradient_accumulation_steps": 1}
  cfg = from_ds(ds, devices=8)
  assert (cfg.mesh.context, cfg.mesh.fsdp) == (4, -1)
  assert mesh_lib.resolve_shape(cfg.mesh, 8) == (1, 2, 1)  # DeepSpeed's data group: 8 / 4
  assert cfg.context.strategy == "all_gather"
  assert "Ulysses' all-to-all over heads" in deepspeed.translate(ds, base()).settings[
      "context.strategy"][1]


def test_auto_fields_take_the_base_values():
  # The Hugging Face Trainer's ds_config: every size and hyperparameter "auto".
  ds = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                  "weight_decay": "auto"}},
        "scheduler": {"type": "WarmupDecayLR",
                      "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                 "warmup_num_steps": "auto", "total_num_steps": "auto"}},
        "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}}
  b = base()
  cfg = from_ds(ds, b)
  # (A ZeRO stage skips a step whose gradient norm is not finite, as DeepSpeed's does.)
  expected = dataclasses.replace(b.train, schedule="warmup_linear_decay", warmup_type="log",
                                 nonfinite="skip")
  assert cfg.train == expected
  # Gradients reduced in the training dtype, the base's float32: said explicitly.
  assert cfg.precision == b.precision and cfg.mesh == b.mesh
  assert cfg.zero == dataclasses.replace(b.zero, reduce_dtype="float32")
  # --print-config says each of them was the base's.
  assert {"optimizer.params.lr", "optimizer.params.betas", "optimizer.params.eps",
          "optimizer.params.weight_decay"} <= deepspeed.translate(ds, b).autos


def test_batch_rule_any_two_give_the_third():
  got = from_ds({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 2}).train
  assert got.grad_accum == 4
  got = from_ds({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}).train
  assert (got.global_batch, got.grad_accum) == (48, 3)
  # One size alone: DeepSpeed's rule accumulates nothing (gradient_accumulation_steps 1, not
  # the base's 2); the mesh is never changed: a mesh of -1 takes the devices there are.
  any_mesh = dataclasses.replace(base(), mesh=config.MeshConfig(replica=2, fsdp=-1))
  got = from_ds({"train_micro_batch_size_per_gpu": 2}, any_mesh)
  assert (got.mesh, got.train.global_batch, got.train.grad_accum) == (any_mesh.mesh, 16, 1)
  tr = deepspeed.translate({"train_batch_size": 64}, base())
  assert deepspeed.resolve_batch(tr.apply(base()), tr, 8)[1]["train.grad_accum"].startswith(
      "no gradient_accumulation_steps: DeepSpeed's rule")
  # "auto" is the run's (the base's): the HF Trainer fills it so.
  got = from_ds({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": "auto"})
  assert (got.train.global_batch, got.train.grad_accum) == (32, 2)
  # --set train.global_batch stands for train_batch_size: the accumulation follows from it.
  tr = deepspeed.translate({"train_micro_batch_size_per_gpu": 2}, base())
  got = deepspeed.resolve_batch(dataclasses.replace(tr.apply(base()), train=dataclasses.replace(
      base().train, global_batch=64)), tr, 8, from_set=("train.global_batch",))[0].train
  assert (got.global_batch, got.grad_accum) == (64, 4)
  # What cannot be derived is the base's.
  got = from_ds({"gradient_accumulation_steps": 4}).train
  assert (got.global_batch, got.grad_accum) == (32, 4)
  assert from_ds({"train_batch_size": 64}, any_mesh, devices=4).train.global_batch == 64


def test_auto_is_filled_from_the_run_never_against_it():
  # A ZeRO-3 + CPU-offload config as the HF integration writes it, on 8 devices.
  ds = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 8}
  got = from_ds(ds).train
  assert (got.global_batch, got.grad_accum) == (64, 8)
  any_mesh = dataclasses.replace(base(), mesh=config.MeshConfig(replica=1, fsdp=-1))
  assert from_ds(ds, any_mesh, devices=4).train.global_batch == 32  # the devices there are
  ds_gas = {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": "auto"}
  assert from_ds(ds_gas).train.grad_accum == 4


def test_three_fixed_batch_sizes_against_the_devices_are_one_line_with_the_arithmetic():
  ds = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 8}
  with pytest.raises(ConfigError) as e:
    from_ds(ds)
  assert str(e.value) == (
      "ds_config: train_batch_size=32 != train_micro_batch_size_per_gpu 1 x "
      "gradient_accumulation_steps 8 x 8 data-parallel devices = 64; use a mesh of 4 "
      "data-parallel devices (mesh.replica x mesh.fsdp), or --set train.global_batch=64 (or "
      "train.grad_accum) over the file")
  # Either way out works: --set over the file, or the mesh.
  fixed = dataclasses.replace(base(), train=dataclasses.replace(base().train, global_batch=64))
  assert from_ds(ds, fixed, from_set=("train.global_batch",)).train.global_batch == 64
  four = dataclasses.replace(base(), mesh=config.MeshConfig(replica=1, fsdp=4))
  assert from_ds(ds, four, devices=4).train.global_batch == 32
  with pytest.raises(ConfigError, match="train_batch_size=36 is not divisible by "
                     "train_micro_batch_size_per_gpu 1 x 8 data-parallel devices"):
    from_ds({"train_batch_size": 36, "train_micro_batch_size_per_gpu": 1})


@pytest.mark.parametrize("ds, message", [
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}},
     "fp16.enabled and bf16.enabled are both true; enable one"),
    ({"fp16": {"enabled": True, "loss_scale": -1}},
     "fp16.loss_scale=-1 must be a number of at least 0"),
    ({"fp16": {"enabled": True, "initial_scale_power": 4, "min_loss_scale": 32}},
     "fp16.min_loss_scale=32 must be positive and at most the initial scale "
     "2**fp16.initial_scale_power = 16"),
    ({"fp16": {"enabled": True, "loss_scale_window": 0}},
     "fp16.loss_scale_window=0 must be an integer of at least 1"),
    ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}},
     "jaxzero keeps fp32 master weights"),
    ({"optimizer": {"type": "Lamb", "params": {}}}, "optimizer.type='Lamb' is not available"),
    ({"scheduler": {"type": "OneCycle", "params": {}}},
     "scheduler.type='OneCycle' is not available"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "beta": [0.9, 0.95]}}},
     "unknown key 'optimizer.params.beta'"),
    ({"csv_monitor": {"enabled": True}}, "csv_monitor.enabled=true"),
    ({"wandb": {"enabled": True, "projekt": "x"}}, "unknown key 'wandb.projekt'"),
    ({"zero_optimization": {"zero_quantized_weights": True}},
     "quantized weights are not available"),
    ({"pipeline": {"stages": 2, "partition": "type:LlamaDecoderLayer"}},
     "pipeline.partition='type:LlamaDecoderLayer' is not available"),
    ({"tensor_parallel": {"tp": {"tp_size": 2}}},
     "tensor_parallel.tp: DeepSpeed's inference tensor parallelism is not available"),
    ({"pipeline": {"stages": 3}}, "mesh.pipeline=3 does not divide model.n_layers=4"),
])
def test_known_but_unhonourable_and_unknown_keys_are_refused(ds, message):
  with pytest.raises(ConfigError) as e:
    from_ds(ds)
  assert message in str(e.value)


@pytest.mark.parametrize("ds, message", [
    ({"scheduler": {"type": ["WarmupLR"]}}, "scheduler.type=['WarmupLR'] is not available; "
     "choose one of: WarmupLR, WarmupDecayLR, WarmupCosineLR"),
    ({"data_types": {"grad_accum_dtype": ["fp32"]}}, "data_types.grad_accum_dtype=['fp32'] is "
     "not available; choose one of: fp32, bf16, fp16 (or float32, float, torch.float32, "
     "bfloat16, torch.bfloat16, float16, half, torch.float16)"),
    ({"communication_data_type": {"dtype": "bf16"}}, "communication_data_type={'dtype': 'bf16'} "
     "is not available; choose one of: fp32, bf16, fp16"),
])
def test_a_list_or_mapping_where_a_name_goes_is_one_line(ds, message):
  with pytest.raises(ConfigError) as e:
    from_ds(ds)
  assert str(e.value) == f"ds_config: {message}"


# ----------------------------------------------------------------------------
# Schedules: DeepSpeed's formulas (deepspeed/runtime/lr_schedules.py), written
# out here in DeepSpeed's own parameters, at iteration n of update n.


def ds_warmup_gamma(n, warmup_num_steps, warmup_type):
  warmup = max(2, warmup_num_steps)
  if warmup_type == "log":
    return math.log(n + 1) / math.log(warmup)
  return n / warmup


def ds_warmup_lr(n, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type):
  gamma = ds_warmup_gamma(n, warmup_num_steps, warmup_type) if n < max(2, warmup_num_steps) else 1.0
  return warmup_min_lr + (warmup_max_lr - warmup_min_lr) * gamma


def ds_warmup_decay_lr(n, total_num_steps, warmup_min_lr, warmup_max_lr, warmup_num_steps,
                       warmup_type):
  warmup = max(2, warmup_num_steps)
  if n < warmup:
    gamma = ds_warmup_gamma(n, warmup_num_steps, warmup_type)
  else:
    gamma = max(0.0, (total_num_steps - n) / max(1.0, total_num_steps - warmup))
  return warmup_min_lr + (warmup_max_lr - warmup_min_lr) * gamma


def ds_warmup_cosine_lr(n, lr, total_num_steps, warmup_min_ratio, warmup_num_steps,
                        cos_min_ratio, warmup_type):
  warmup = max(2, warmup_num_steps)
  if n < warmup:
    ratio = ds_warmup_gamma(n, warmup_num_steps, warmup_type)
    return lr * (warmup_min_ratio + ratio * (1 - warmup_min_ratio))
  progress = min(1.0, (n - warmup + 1) / max(1, total_num_steps - warmup))
  ratio = (1 + math.cos(math.pi * progress)) / 2
  return lr * max(0.0, cos_min_ratio + (1 - cos_min_ratio) * ratio)


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
@pytest.mark.parametrize("kind, params, formula", [
    ("WarmupLR", dict(warmup_min_lr=1e-5, warmup_max_lr=3e-4, warmup_num_steps=12),
     ds_warmup_lr),
    ("WarmupDecayLR", dict(total_num_steps=40, warmup_min_lr=2e-5, warmup_max_lr=3e-4,
                           warmup_num_steps=10), ds_warmup_decay_lr),
    ("WarmupCosineLR", dict(total_num_steps=40, warmup_min_ratio=0.05, warmup_num_steps=10,
                            cos_min_ratio=0.1), ds_warmup_cosine_lr),
])
def test_schedule_equals_deepspeeds_formula(kind, params, formula, warmup_type):
  lr = 4e-4  # the optimizer's lr: WarmupCosineLR scales it
  ds = {"optimizer": {"type": "AdamW", "params": {"lr": lr}},
        "scheduler": {"type": kind, "params": {**params, "warmup_type": warmup_type}}}
  schedule = engine_lib.learning_rate_schedule(from_ds(ds))
  updates = np.arange(50)  # past the end too: every schedule holds its last value
  got = np.asarray(schedule(jnp.asarray(updates)))
  extra = {"lr": lr} if kind == "WarmupCosineLR" else {}
  # DeepSpeed's engine steps the scheduler after each update: update u runs at
  # iteration u - 1, and update 0 at the scheduler's start (warmup_min_lr; 0 for cosine).
  start = params.get("warmup_min_lr", 0.0)
  want = np.array([start] + [formula(int(u) - 1, **extra, **params, warmup_type=warmup_type)
                             for u in updates[1:]])
  np.testing.assert_allclose(got, want, rtol=1e-7, atol=0)


@pytest.mark.parametrize("kind, params", [
    ("WarmupLR", dict(warmup_min_lr=1e-5, warmup_max_lr=3e-4, warmup_num_steps=12)),
    ("WarmupDecayLR", dict(total_num_steps=40, warmup_min_lr=0.0, warmup_max_lr=3e-4,
                           warmup_num_steps=10)),
    ("WarmupCosineLR", dict(total_num_steps=40, warmup_min_ratio=0.05, warmup_num_steps=10,
                            cos_min_ratio=0.1)),
])
def test_every_update_gets_the_learning_rate_deepspeeds_engine_uses(kind, params):
  """Pinned to DeepSpeed's own scheduler objects, stepped as its engine steps them:
  the optimizer's lr is read at the update, and the scheduler steps after it."""
  lr_schedules = pytest.importorskip("deepspeed.runtime.lr_schedules",
                                     reason="DeepSpeed is not installed (pip install deepspeed)")
  torch = pytest.importorskip("torch")
  lr = 4e-4
  optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
  scheduler = getattr(lr_schedules, kind)(optimizer, **params)
  theirs = []
  for _ in range(45):
    theirs.append(optimizer.param_groups[0]["lr"])
    scheduler.step()
  ds = {"optimizer": {"type": "AdamW", "params": {"lr": lr}},
        "scheduler": {"type": kind, "params": params}}
  ours = engine_lib.learning_rate_schedule(from_ds(ds))(jnp.arange(45))
  np.testing.assert_allclose(np.asarray(ours)[:3], theirs[:3], rtol=1e-7, atol=0)  # the start
  np.testing.assert_allclose(np.asarray(ours), theirs, rtol=1e-7, atol=0)


def test_default_schedule_is_unchanged():
  cfg = base()
  assert cfg.train.schedule == "warmup_cosine" and cfg.train.optimizer == "adamw"
  t = cfg.train
  reference = optax.warmup_cosine_decay_schedule(
      0.0, t.lr, t.warmup_steps, t.steps, t.lr * t.min_lr_ratio)
  counts = jnp.arange(t.steps + 5)
  np.testing.assert_array_equal(engine_lib.learning_rate_schedule(cfg)(counts), reference(counts))


# ----------------------------------------------------------------------------
# Runs, migrate, the command line

SMALL = ["model.dim=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1",
         "model.mlp_dim=64", "train.seq_len=16", "data.max_bytes=100000", "train.log_every=1",
         "mesh.fsdp=1"]
RUN_DS = {
    "train_batch_size": 16, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
    "bf16": {"enabled": False},
    "optimizer": {"type": "Adam", "params": {"lr": 3e-3, "betas": [0.9, 0.95],
                                             "weight_decay": 0.01, "adam_w_mode": False}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 4, "warmup_num_steps": 2,
                                                      "warmup_max_lr": 3e-3,
                                                      "warmup_min_lr": 7.5e-4,
                                                      "warmup_type": "linear"}},
    "zero_optimization": {"stage": 2, "overlap_comm": True},
}
RUN_SET = ["zero.stage=2", "zero.reduce_dtype=float32", "train.nonfinite=skip",
           "train.global_batch=16", "train.grad_accum=2", "train.clip_norm=1.0",
           "precision.compute=float32", "train.optimizer=adam", "train.lr=0.003", "train.b1=0.9",
           "train.b2=0.95", "train.eps=1e-8", "train.weight_decay=0.01",
           "train.schedule=warmup_linear_decay", "train.steps=4", "train.warmup_steps=2",
           "train.warmup_min_ratio=0.25", "train.warmup_type=linear"]


@pytest.mark.slow
def test_ds_config_run_trains_to_the_losses_of_the_set_run(tmp_path, caplog):
  ds_file = tmp_path / "ds_config.json"
  ds_file.write_text(json.dumps(RUN_DS))
  # As `jaxzero.train --config TINY --deepspeed ds_config.json --set ...` loads it:
  # the file over the base, --set over that.
  args = argparse.Namespace(config=TINY, deepspeed=str(ds_file), accelerate_config=None,
                            set=SMALL)
  with caplog.at_level(logging.INFO):
    ds_cfg = cli.load_config(args).resolve(1)
  assert sum("not needed under XLA" in r.getMessage() for r in caplog.records) == 1
  set_cfg = config.load(TINY, RUN_SET + SMALL)
  assert ds_cfg == set_cfg
  one = jax.devices()[:1]  # mesh.fsdp=1 compiles fastest
  ds_losses = [h["loss"] for h in loop.train(ds_cfg, tmp_path / "ds", devices=one,
                                                progress=False)]
  set_losses = [h["loss"] for h in loop.train(set_cfg, tmp_path / "set", devices=one,
                                                 progress=False)]
  assert len(ds_losses) == 4 and ds_losses[-1] < ds_losses[0]
  np.testing.assert_allclose(ds_losses, set_losses, rtol=1e-6)


def test_migrate_output_resolves_to_the_same_config(tmp_path, capsys):
  ds_file = tmp_path / "ds_config.json"
  ds_file.write_text(json.dumps(RUN_DS))
  assert migrate.main([str(ds_file), "--base", TINY]) == 0
  text = capsys.readouterr().out
  assert "# optimizer.params.weight_decay" in text and "zero_optimization.overlap_comm" in text
  migrated = tmp_path / "migrated.py"
  migrated.write_text(text)
  direct = from_ds(RUN_DS)
  assert config.load(str(migrated)) == direct
  assert config.load(str(migrated), SMALL) == config.load(TINY, RUN_SET + SMALL)


def test_an_integer_too_large_for_a_float_is_one_line(tmp_path):
  huge = 10 ** 400
  tr = deepspeed.translate({"train_micro_batch_size_per_gpu": huge}, base())
  assert tr.batch["train_micro_batch_size_per_gpu"] == huge  # whole; the arithmetic refuses it


def test_a_batch_from_the_device_count_is_found_on_the_devices_the_run_uses(tmp_path, capsys,
                                                                           monkeypatch):
  """Micro-batch 2 x accumulation 4 is a global batch of 2 x 4 x the devices: migrate writes
  it for --devices N (else says which count it assumed), and --print-config finds it on
  JAX's devices, as training does (a GPU machine's, not 8)."""
  from jaxzero import train
  ds_file = write(tmp_path, "mb.json", '{"train_micro_batch_size_per_gpu": 2, '
                  '"gradient_accumulation_steps": 4}')
  assert migrate.main([ds_file, "--devices", "4"]) == 0
  assert "global_batch=32,  # auto: " in capsys.readouterr().out
  assert migrate.main([ds_file]) == 0
  assert "(for 8 devices: jaxzero.migrate --devices N for yours)" in capsys.readouterr().out
  monkeypatch.setattr(jax, "device_count", lambda: 2)
  assert train.main(["--config", TINY, "--deepspeed", ds_file, "--set", "mesh.fsdp=-1",
                     "--print-config"]) == 0
  assert "train.global_batch=16  # auto: " in capsys.readouterr().out
  # A mesh that names its size (here more devices than this machine has: a multi-host
  # run's) is resolved on that size.
  assert train.main(["--config", TINY, "--deepspeed", ds_file, "--set", "mesh.fsdp=16",
                     "--print-config"]) == 0
  assert "train.global_batch=128  # auto: " in capsys.readouterr().out


def write(tmp_path, name, text):
  path = tmp_path / name
  path.write_text(text)
  return str(path)


@pytest.mark.parametrize("name, text, message", [
    ("unknown.json", '{"zero_optimization": {"stage": 3, "overlap_com": true}}',
     "unknown key 'zero_optimization.overlap_com': jaxzero does not know it; "
     "did you mean 'zero_optimization.overlap_comm'?"),
    ("batch.json", '{"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2, '
     '"gradient_accumulation_steps": 4}',
     "train_batch_size=32 != train_micro_batch_size_per_gpu 2 x gradient_accumulation_steps 4 x "
     "8 data-parallel devices = 64; use a mesh of 4 data-parallel devices"),
    ("block.json", '{"fp16": true}', "block.json: fp16 must be a mapping of keys to values, "
     "not True"),
    ("gas.json", '{"gradient_accumulation_steps": 3}', "gas.json: train.global_batch=32 (the "
     "config's: the file gives no train_batch_size) is not divisible by "
     "gradient_accumulation_steps 3 x 8 data-parallel devices"),
    ("stage.json", '{"zero_optimization": {"stage": 5}}',
     "zero_optimization.stage=5 is not valid; choose one of: 0, 1, 2, 3"),
    ("malformed.json", '{\n  "train_batch_size": 32,\n  "bf16": {"enabled" true}\n}',
     "not valid JSON at line 3 column 22: Expecting ':' delimiter"),
    ("twice.json", '{"bf16": {"enabled": true, "enabled": false}}',
     "twice.json: key 'enabled' is given twice in one object; DeepSpeed refuses duplicate "
     "keys, give it once"),
    # hjson (DeepSpeed's reader) takes the unquoted `true "offload...` as one string, and
    # the offload it names was silently gone.
    ("comma.json", '{"zero_optimization": {"stage": 3,\n  "overlap_comm": true '
     '"offload_optimizer": {"device": "cpu"},\n  "contiguous_gradients": true}}',
     "comma.json: zero_optimization.overlap_comm reads as the text 'true \"offload_optimizer\": "
     "{\"device\": \"cpu\"},': a comma is missing before the key in it"),
])
def test_bad_ds_config_is_one_line_and_exit_code_2(name, text, message, tmp_path, capsys):
  code = train_cli.main(["--config", TINY, "--deepspeed", write(tmp_path, name, text),
                         "--workdir", str(tmp_path / "w")])
  errors = capsys.readouterr().err.strip().splitlines()
  assert code == 2 and len(errors) == 1 and message in errors[0], errors
  assert not (tmp_path / "w").exists()


def test_steps_per_print_spaces_deepspeeds_own_print_not_the_metrics():
  tr = deepspeed.translate({"steps_per_print": 2000}, base())  # HF's example configs' value
  assert "train.log_every" not in tr.settings
  assert tr.unneeded["steps_per_print"] == (
      "metrics are logged every train.log_every steps (the base's)")


def test_deepspeed_019_keys_are_known():
  """Keys DeepSpeed 0.19 takes: tuning knobs and disabled features accepted as unneeded;
  features that change what trains refused as unsupported, not as typos."""
  tr = deepspeed.translate({
      "hybrid_engine": {"enabled": False, "max_out_tokens": 512}, "dataloader_drop_last": True,
      "torch_autocast": {"enabled": False}, "curriculum_learning": {"enabled": False},
      "data_efficiency": {"enabled": False, "data_sampling": {"curriculum_learning": {}}},
      "zero_optimization": {
          "stage": 3, "stage3_module_granularity_threshold": 0, "leaf_module": {},
          "stage3_allgather_sequential": False, "log_trace_cache_warnings": False,
          "compute_grad_norm": True, "parameter_alignment": False, "legacy_stage1": False,
          "pipeline_loading_checkpoint": False, "override_module_apply": True,
          "enable_sanity_checks": False, "zenflow": None,
          "offload_optimizer": {"device": "cpu", "cpuadam_cores_perc": 0.8}},
      # DeepSpeed 0.19's runtime/config.py and constants.py.
      "disable_allgather": False, "dump_state": False, "log_level": "info", "timers": {},
      "disable_python_gc": True, "seq_parallel_communication_data_type": "fp32",
      "gradient_allreduce_op": "MEAN", "managed_gradient_accumulation": True,
      "optimizer": {"type": "AdamW", "legacy_fusion": False, "params": {"lr": 1e-3}}}, base())
  assert {"hybrid_engine", "dataloader_drop_last", "torch_autocast", "data_efficiency",
          "zero_optimization.leaf_module", "zero_optimization.compute_grad_norm",
          "zero_optimization.enable_sanity_checks",
          "zero_optimization.offload_optimizer.cpuadam_cores_perc", "disable_allgather",
          "dump_state", "log_level", "timers", "disable_python_gc",
          "seq_parallel_communication_data_type", "gradient_allreduce_op",
          "managed_gradient_accumulation", "optimizer.legacy_fusion"} <= set(tr.unneeded)
  assert tr.unneeded["hybrid_engine"] == "disabled, as DeepSpeed's default"
  unsupported = "is a DeepSpeed setting jaxzero does not support; leave it disabled"
  for ds, message in (
      ({"hybrid_engine": {"enabled": True}}, "hybrid_engine.enabled=true: DeepSpeed's hybrid "
       f"engine (generation inside RLHF training) {unsupported}"),
      ({"torch_autocast": {"enabled": True, "dtype": "bfloat16"}},
       f"torch_autocast.enabled=true: torch autocast {unsupported} and enable bf16 instead"),
      ({"data_efficiency": {"data_routing": {"random_ltd": {"enabled": True}}}},
       "data_efficiency.data_routing.random_ltd.enabled=true: data efficiency (curriculum "
       f"learning, random-LTD) {unsupported}"),
      ({"curriculum_learning": {"enabled": True}},
       f"curriculum_learning.enabled=true: curriculum learning {unsupported}"),
      ({"gradient_allreduce_op": "sum"}, "gradient_allreduce_op='sum': summed gradients (N "
       "devices' times the mean) are not available; leave it out (DeepSpeed's default is "
       "'mean')"),
      ({"gradient_allreduce_op": ["mean"]}, "gradient_allreduce_op=['mean'] is not one of "
       "DeepSpeed's values: 'mean', 'sum'"),
      ({"managed_gradient_accumulation": False}, "managed_gradient_accumulation=False: the "
       "script owning the accumulation boundary is not available: a step runs "
       "train.grad_accum micro-batches; leave it out (DeepSpeed's default is True)"),
      ({"optimizer": {"type": "AdamW", "params": {"max_grad_norm": 1.0}}},
       "optimizer.params.max_grad_norm: DeepSpeed refuses it as an optimizer parameter; set "
       "gradient_clipping (train.clip_norm) instead"),
      ({"zero_optimization": {"stage": 2, "zenflow": {"topk_ratio": 0.1}}},
       "zero_optimization.zenflow: ZenFlow (the less important gradients applied late, from "
       "the CPU) is a DeepSpeed setting jaxzero does not support; leave it out")):
    with pytest.raises(ConfigError) as e:
      deepspeed.translate(ds, base())
    assert str(e.value) == f"ds_config: {message}"


def test_a_string_holding_escaped_quotes_and_a_colon_is_a_value_not_a_missing_comma(tmp_path):
  path = write(tmp_path, "group.json", json.dumps({"wandb": {"enabled": True,
                                                             "group": 'sweep "lr": 1e-4'}}))
  assert read_mapping(path, "DeepSpeed")["wandb"]["group"] == 'sweep "lr": 1e-4'


def test_a_ds_config_is_read_as_deepspeed_reads_it(tmp_path, monkeypatch):
  """With hjson, as DeepSpeed: a byte-order mark, comments and trailing commas; without it,
  JSON and a line saying what hjson would add. A file that cannot be read is one line."""
  path = write(tmp_path, "hjson.json", '\ufeff{\n  // ZeRO-2\n  "zero_optimization": '
               '{"stage": 2,},\n  "bf16": {"enabled": true}, # bf16\n}\n')
  assert read_mapping(path, "DeepSpeed") == {"zero_optimization": {"stage": 2},
                                             "bf16": {"enabled": True}}
  monkeypatch.setitem(sys.modules, "hjson", None)  # not installed
  with pytest.raises(ConfigError) as e:
    read_mapping(path, "DeepSpeed")
  assert str(e.value) == (f"{path}: not valid JSON at line 2 column 3: Expecting property name "
                          "enclosed in double quotes; comments and trailing commas (DeepSpeed's "
                          "hjson) need pip install hjson")
  assert read_mapping(write(tmp_path, "bom.json", '\ufeff{"bf16": {}}'), "DeepSpeed") == {
      "bf16": {}}
  latin = tmp_path / "latin.json"
  latin.write_bytes(b'{\n"wandb": {"project": "caf\xe9"}}')
  (tmp_path / "dir.json").mkdir()
  for bad, message in ((str(latin), f"{latin}: not UTF-8 text (byte 0xe9 on line 2); save it "
                        "as UTF-8"),
                       (str(tmp_path / "dir.json"), f"DeepSpeed config '{tmp_path}/dir.json' is "
                        "a directory; give the file in it")):
    with pytest.raises(ConfigError) as e:
      read_mapping(bad, "DeepSpeed")
    assert str(e.value) == message
  def refused(self):
    raise PermissionError(13, "Permission denied")
  monkeypatch.setattr(pathlib.Path, "read_bytes", refused)
  with pytest.raises(ConfigError, match="^DeepSpeed config '.*bom.json' cannot be read: "
                     "Permission denied$"):
    read_mapping(str(tmp_path / "bom.json"), "DeepSpeed")


def test_set_stage_fixes_the_strategy_of_a_mics_block(tmp_path, capsys):
  path = write(tmp_path, "mics.json", '{"zero_optimization": {"stage": 3, "mics_shard_size": 4}}')
  assert train_cli.main(["--config", TINY, "--deepspeed", path, "--set", "zero.stage=2",
                         "--print-config"]) == 0
  lines = set(capsys.readouterr().out.splitlines())
  where = "mics.json: zero_optimization.mics_shard_size"
  assert {"zero.stage=2  # --set", f"zero.hybrid=True  # {where}",
          f"zero.strategy=  # --set zero.stage replaces HYBRID_SHARD ({where})",
          f"mesh.fsdp=4  # {where}"} <= lines, lines


@pytest.mark.slow
def test_bad_ds_config_exits_2_from_the_command_line(tmp_path):
  path = write(tmp_path, "fp16.json", '{"fp16": {"enabled": true}, "bf16": {"enabled": true}}')
  result = run_python("-m", "jaxzero.train", "--config", TINY, "--deepspeed", path, timeout=120)
  assert result.returncode == 2
  assert result.stderr.strip().splitlines() == [
      "jaxzero.train: error: fp16.json: fp16.enabled and bf16.enabled are both true; "
      "enable one"]


def test_an_auto_precision_block_follows_the_dtype_set_on_the_command_line(tmp_path, capsys):
  """The HF Trainer's "enabled": "auto" follows its --fp16/--bf16 flags; here --set
  precision.compute: the fp16 block's scaler applies, and gradients are float16."""
  from jaxzero import train
  ds_file = write(tmp_path, "auto.json", json.dumps({
      "fp16": {"enabled": "auto", "loss_scale_window": 100, "initial_scale_power": 12},
      "bf16": {"enabled": "auto"}}))
  assert train.main(["--config", TINY, "--deepspeed", ds_file, "--set",
                     "precision.compute=float16", "--print-config"]) == 0
  printed = dict(line.split("  # ")[0].split("=", 1)
                 for line in capsys.readouterr().out.splitlines())
  assert {k: printed[k] for k in ("precision.compute", "precision.loss_scale_window",
                                  "precision.initial_scale_power", "zero.grad_dtype")} == {
      "precision.compute": "float16", "precision.loss_scale_window": "100",
      "precision.initial_scale_power": "12", "zero.grad_dtype": "float16"}


def test_what_the_file_derives_from_the_config_sees_the_command_lines_set(tmp_path, capsys):
  """The HF Trainer fills "auto" from its command line (--learning_rate): --set train.lr
  is the lr a WarmupLR floor is a ratio of (it was the config file's: 30x off)."""
  from jaxzero import train
  ds_file = write(tmp_path, "auto.json", json.dumps({
      "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
      "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-5,
                                                   "warmup_max_lr": "auto",
                                                   "warmup_num_steps": 5}}}))
  assert train.main(["--config", TINY, "--deepspeed", ds_file, "--set", "train.lr=1e-4",
                     "--print-config"]) == 0
  printed = dict(line.split("  # ")[0].split("=", 1)
                 for line in capsys.readouterr().out.splitlines())
  assert float(printed["train.lr"]) == 1e-4
  assert float(printed["train.warmup_min_ratio"]) == pytest.approx(0.1)  # 1e-5 / 1e-4
  # The layout is the file's, read against the config file: --set mesh.replica applies
  # after it (an AutoTP file gives the data axis the devices left: fsdp -1).
  tp_file = write(tmp_path, "tp.json", json.dumps({"tensor_parallel": {"autotp_size": 2}}))
  assert train.main(["--config", TINY, "--deepspeed", tp_file, "--set", "mesh.replica=2",
                     "--print-config"]) == 0
  assert "mesh.fsdp=-1  # tp.json: tensor_parallel.autotp_size" in capsys.readouterr().out


def test_files_from_the_wild_read_as_deepspeed_reads_them():
  """What each of these files means in DeepSpeed 0.19: an "auto" precision block applies in
  full where the run trains in its dtype, "auto" peaks at the optimizer's lr, the legacy
  cpu_offload_param, bf16 before bfloat16, and the bf16 block's newer keys."""
  fp16_base = dataclasses.replace(base(), precision=config.PrecisionConfig(compute="float16"))
  cfg = from_ds({"fp16": {"enabled": "auto", "initial_scale_power": 12,
                          "loss_scale_window": 100}}, fp16_base)
  assert_fields(cfg, precision__compute="float16", precision__initial_scale_power=12,
                precision__loss_scale_window=100, zero__grad_dtype="float16")
  assert from_ds({"fp16": {"enabled": "auto", "initial_scale_power": 12}}
                 ).precision.compute == "float32"  # the base trains in fp32
  cfg = from_ds({"optimizer": {"type": "AdamW", "params": {"lr": 1e-5}},
                 "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}}})
  assert cfg.train.lr == 1e-5
  tr = deepspeed.translate({"optimizer": {"type": "AdamW", "params": {"lr": 1e-5}},
                            "scheduler": {"type": "WarmupLR", "params": {}}}, base())
  assert tr.settings["train.lr"] == (1e-5, "no scheduler.params.warmup_max_lr: WarmupLR's "
                                           "default, the optimizer's lr")
  cfg = from_ds({"zero_optimization": {"stage": 3, "cpu_offload_param": True,
                                       "cpu_offload": True}})
  assert_fields(cfg, offload__params="pinned_host", offload__optimizer="pinned_host")
  assert from_ds({"bf16": {"enabled": True}, "bfloat16": {"enabled": False}}
                 ).precision.compute == "bfloat16"
  assert from_ds({"bf16": {"enabled": True, "check_grad_overflow": True,
                           "bf16_master_weights_and_grads": False}}).precision.compute == (
                               "bfloat16")
  # cpu_checkpointing moves what the model checkpoints; a base that checkpoints nothing
  # keeps nothing to move.
  no_remat = dataclasses.replace(base(), remat=config.RematConfig(policy="none"))
  assert from_ds({"activation_checkpointing": {"cpu_checkpointing": True}},
                 no_remat).remat.policy == "none"
  with pytest.raises(ConfigError, match="bf16.bf16_master_weights_and_grads=true: jaxzero keeps"):
    from_ds({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True,
                      "bf16_optimizer_states": True}})
