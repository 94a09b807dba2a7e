"""DeepSpeed configs as they circulate run as written: an fp16 ZeRO-2 config from a
tutorial, and a ZeRO-3 + CPU-offload config with the Hugging Face integration's
"auto" fields, on the tiny preset and 8 devices, with no edit and no --set."""

import json

import pytest

from jaxzero import config, migrate
from jaxzero import train as train_cli

from processes import TINY, child_env, run_python

FP16_TUTORIAL = {
    "train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 2e-5, "betas": [0.9, 0.999], "eps": 1e-8,
                                              "weight_decay": 0.01}},
    "fp16": {"enabled": True, "loss_scale_window": 100},
    "zero_optimization": {"stage": 2, "contiguous_gradients": True, "overlap_comm": True,
                          "reduce_bucket_size": 5e8},
    "gradient_clipping": 1.0}
ZERO3_OFFLOAD_AUTO = {
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 8, "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR",
                  "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                             "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "overlap_comm": True, "reduce_bucket_size": "auto",
                          "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto",
                          "stage3_gather_16bit_weights_on_model_save": True}}


def write(tmp_path, ds: dict):
  path = tmp_path / "ds_config.json"
  path.write_text(json.dumps(ds))
  return str(path)


@pytest.mark.slow
@pytest.mark.parametrize("ds, steps", [(FP16_TUTORIAL, 12), (ZERO3_OFFLOAD_AUTO, 3)],
                         ids=["fp16_zero2", "zero3_offload_auto"])
def test_a_config_from_the_wild_trains_as_written(ds, steps, tmp_path, tmp_path_factory):
  env = child_env(tmp_path_factory.getbasetemp() / "jax_compilation_cache")
  result = run_python("-m", "jaxzero.train", "--config", TINY, "--deepspeed", write(tmp_path, ds),
                      "--workdir", str(tmp_path / "w"), "--steps", str(steps), "--no-progress",
                      env=env, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  records = [json.loads(line)
             for line in (tmp_path / "w" / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records] == list(range(1, steps + 1))
  assert records[-1]["loss"] < records[0]["loss"]
  if ds is FP16_TUTORIAL:
    assert all(r["loss_scale"] == 2.0 ** 16 and r["skipped_steps"] == 0 for r in records)


def test_print_config_resolves_every_fp16_key_and_says_where_each_came_from(tmp_path, capsys):
  assert train_cli.main(["--config", TINY, "--deepspeed", write(tmp_path, FP16_TUTORIAL),
                         "--set", "train.steps=7", "--print-config"]) == 0
  lines = dict(line.split("=", 1) for line in capsys.readouterr().out.splitlines())
  assert lines["precision.compute"] == "float16  # ds_config.json: fp16.enabled"
  assert lines["precision.loss_scale_window"] == "100  # ds_config.json: fp16.loss_scale_window"
  for key, value in (("loss_scale", "0.0"), ("initial_scale_power", "16"), ("hysteresis", "2"),
                     ("consecutive_hysteresis", "False"), ("min_loss_scale", "1.0")):
    assert lines[f"precision.{key}"] == f"{value}  # ds_config.json: fp16.{key}"
  assert lines["train.global_batch"] == "32  # ds_config.json: train_batch_size"
  assert lines["train.grad_accum"] == ("1  # auto: train_batch_size 32 / "
                                       "(train_micro_batch_size_per_gpu 4 x 8 devices)")
  assert lines["train.steps"] == "7  # --set"
  assert lines["train.seq_len"] == "128  # base"


def test_set_fixes_what_the_file_sets(tmp_path, capsys):
  contradiction = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 1,
                   "gradient_accumulation_steps": 8, "fp16": {"enabled": True}}
  path = write(tmp_path, contradiction)
  assert train_cli.main(["--config", TINY, "--deepspeed", path, "--print-config"]) == 2
  assert "--set train.global_batch=64" in capsys.readouterr().err
  assert train_cli.main(["--config", TINY, "--deepspeed", path, "--set",
                         "train.global_batch=64", "--set", "precision.compute=bfloat16",
                         "--set", "precision.hysteresis=5", "--print-config"]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert {"train.global_batch=64  # --set", "precision.compute=bfloat16  # --set",
          "precision.hysteresis=5  # --set"} <= set(lines)


def test_migrate_writes_the_fp16_block_and_the_resolved_batch(tmp_path, capsys):
  assert migrate.main([write(tmp_path, FP16_TUTORIAL), "--base", TINY]) == 0
  text = capsys.readouterr().out
  assert "compute='float16',  # fp16.enabled" in text.replace('"', "'")
  assert "loss_scale_window=100,  # fp16.loss_scale_window" in text
  migrated = tmp_path / "migrated.py"
  migrated.write_text(text)
  cfg = config.load(str(migrated))
  assert (cfg.precision.compute, cfg.precision.loss_scale_window) == ("float16", 100)
  assert (cfg.train.global_batch, cfg.train.grad_accum, cfg.zero.stage) == (32, 1, 2)
