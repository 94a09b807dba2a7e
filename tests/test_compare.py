"""scripts/compare.py: DeepSpeed, PyTorch FSDP2 and jaxzero train one job to the same losses."""

import dataclasses
import importlib.util
import json

import pytest

from jaxzero import config

from processes import load_script

# fp32, and nothing DeepSpeed would compile: torch's AdamW (torch_adam), no CPU offload.
# Weight decay 1.0 makes a wrong decay mask show: decaying the norm gains too moves step 4's
# loss by 3.5e-4; the scheduler stepped once too early moves step 3's by 1.5e-2.
DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "bf16": {"enabled": False},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                              "weight_decay": 1.0, "torch_adam": True}},
    "scheduler": {"type": "WarmupDecayLR",
                  "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 3e-3, "warmup_num_steps": 2,
                             "warmup_type": "linear", "total_num_steps": 4}},
    "zero_optimization": {"stage": 3},
}
TINY = ["--dim", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--mlp", "128",
        "--vocab", "256", "--seq", "32", "--max-bytes", "200000", "--nproc", "2"]


@pytest.mark.slow
@pytest.mark.multiprocess
# Stage 3 only (CI time): jaxzero's stage 2 equals its stage 3 and one device
# (tests/engine/test_step.py); `--ds-set zero_optimization.stage=2` runs the comparison there.
@pytest.mark.parametrize("stage", [3])
def test_deepspeed_fsdp2_and_jaxzero_losses_agree(tmp_path, stage):
  for name in ("torch", "transformers", "deepspeed"):
    pytest.importorskip(name, reason=f"{name} is not installed (pip install 'jaxzero[compare]')")
  compare = load_script("compare")
  ds_file = tmp_path / "ds_config.json"
  ds_file.write_text(json.dumps(DS_CONFIG))
  out = tmp_path / "compare.json"
  code = compare.main(["--deepspeed", str(ds_file), "--ds-set", f"zero_optimization.stage={stage}",
                       "--steps", "4", *TINY, "--workdir", str(tmp_path / "runs"),
                       "--json", str(out)])
  assert code == 0
  result = json.loads(out.read_text())
  assert [r["step"] for r in result["steps"]] == [1, 2, 3, 4]
  for row in result["steps"]:
    assert {"deepspeed", "fsdp2", "jaxzero"} <= row.keys()
  assert result["steps"][-1]["jaxzero"] < result["steps"][0]["jaxzero"]  # it trains
  assert result["max_rel_diff"] < 1e-4, result["steps"]
  assert len(result["peak_rss_bytes"]["deepspeed"]) == 2
  assert all(t > 0 for t in result["median_step_time_s"].values())


def test_without_the_extras_names_the_install_and_exits_2(monkeypatch, capsys, tmp_path):
  compare = load_script("compare")
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name == "deepspeed" else real(name, *a))
  assert compare.main(["--deepspeed", str(tmp_path / "ds.json")]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1
  assert "pip install 'jaxzero[compare]'" in err and "deepspeed" in err


@pytest.mark.parametrize("ds_set, message", [
    ("fp16=true", "its fp16, bf16 and zero_optimization entries must be JSON objects"),
    ("zero_optimization.stage.x=1", "zero_optimization.stage is 3, not a block of keys"),
])
def test_a_ds_set_that_breaks_the_file_is_one_line(ds_set, message, monkeypatch, capsys,
                                                    tmp_path):
  compare = load_script("compare")
  monkeypatch.setattr(compare, "missing_extras", lambda: [])
  (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 3}}')
  assert compare.main(["--deepspeed", str(tmp_path / "ds.json"), "--ds-set", ds_set,
                       "--workdir", str(tmp_path / "w")]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and message in err, err


def test_batch_sizes_follow_deepspeeds_rule_and_other_autos_are_refused():
  compare = load_script("compare")
  cfg = config.base()
  cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, global_batch=16,
                                                           grad_accum=8))
  ds = compare.resolved_ds({"train_batch_size": "auto", "bf16": {"enabled": True}}, cfg, 2)
  assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"],
          ds["gradient_accumulation_steps"]) == (16, 1, 8)
  # DeepSpeed's default clipping written out for FSDP2 (it read none: it did not clip).
  assert ds["gradient_clipping"] == 1.0
  assert compare.resolved_ds({"gradient_clipping": 0.0}, cfg, 2)["gradient_clipping"] == 0.0
  with pytest.raises(ValueError, match="optimizer.params.lr"):
    compare.resolved_ds({"optimizer": {"params": {"lr": "auto"}}}, cfg, 2)
  with pytest.raises(ValueError, match=r"zero_optimization.stage is 1, not a block of keys"):
    compare.apply_ds_sets({"zero_optimization": {"stage": 1}}, ["zero_optimization.stage.x=1"])
  with pytest.raises(ValueError, match="not a JSON object"):
    compare.apply_ds_sets([], [])
  changed = compare.apply_ds_sets({"bf16": {"enabled": True}},
                                  ["bf16.enabled=false", "zero_optimization.stage=2"])
  assert changed == {"bf16": {"enabled": False}, "zero_optimization": {"stage": 2}}
