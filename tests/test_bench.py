"""The benchmark's CPU mode runs, so scripts/bench.py cannot rot."""

import json

import pytest

from processes import ROOT, load_script


@pytest.mark.slow
def test_bench_cpu_mode_reports_every_figure(tmp_path):
  pytest.importorskip("torch")
  pytest.importorskip("transformers")
  bench = load_script("bench")
  out = tmp_path / "bench.json"
  code = bench.main(["--config", str(ROOT / "configs" / "tiny_zero3.py"), "--steps", "2",
                     "--warmup", "1", "--torch", "--json", str(out),
                     "--set", "train.seq_len=32", "--set", "train.global_batch=16",
                     "--set", "data.max_bytes=200000", "--set", "model.dim=64",
                     "--set", "model.n_layers=2", "--set", "model.mlp_dim=128"])
  assert code == 0
  jaxzero_result, torch_result = json.loads(out.read_text())
  assert jaxzero_result["framework"] == "jaxzero" and torch_result["framework"] == "pytorch"
  for r in (jaxzero_result, torch_result):
    assert r["step_time_s"] > 0
    assert r["tokens_per_sec"] == pytest.approx(16 * 32 / r["step_time_s"])
    assert r["mfu"] is None  # no peak for a CPU
  # The same model: its FLOPs from the same count (the training log's, for jaxzero).
  assert jaxzero_result["parameters"] == torch_result["parameters"]
  assert jaxzero_result["model_tflops"] / torch_result["model_tflops"] == pytest.approx(
      torch_result["step_time_s"] / jaxzero_result["step_time_s"])


@pytest.mark.parametrize("sets", [["lora.rank=4"], ["model_factory=tiny_lm:make"]])
def test_torch_has_no_reference_for_lora_or_a_model_of_ones_own(sets, capsys):
  bench = load_script("bench")
  code = bench.main(["--config", str(ROOT / "configs" / "tiny_zero3.py"), "--torch",
                     *[a for s in sets for a in ("--set", s)]])
  assert code == 2
  assert "--torch runs the config's Llama as a full fine-tune in PyTorch: it has no reference" \
      in capsys.readouterr().err


def test_model_flops_follow_the_palm_convention():
  bench = load_script("bench")
  import dataclasses  # pylint: disable=import-outside-toplevel
  from jaxzero import config  # pylint: disable=import-outside-toplevel
  from jaxzero.models.llama import LlamaConfig, count_params
  model = LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, mlp_dim=128)
  cfg = dataclasses.replace(config.base(), model=model,
                            train=dataclasses.replace(config.base().train, seq_len=128))
  phi = count_params(model)
  assert bench.model_flops_per_token(cfg, phi) == 6 * phi + 12 * 2 * 64 * 128


def test_a_lora_run_s_mfu_counts_its_frozen_base_as_the_training_log_does(monkeypatch):
  """6 a token for the adapters, 4 for the frozen base (its weights get no gradient), on
  an H100 NVL's own peak (835 TFLOP/s, not the SXM part's 989)."""
  import types
  from jaxzero import config  # pylint: disable=import-outside-toplevel
  from jaxzero.models.llama import count_params
  from jaxzero.training import throughput
  bench = load_script("bench")
  cfg = config.load(str(ROOT / "configs" / "llama8b_lora.py"))
  nvl = types.SimpleNamespace(device_kind="NVIDIA H100 NVL", platform="gpu")
  assert throughput.device_peak_tflops(nvl) == 835.0
  monkeypatch.setattr(bench, "device_peak_tflops", throughput.device_peak_tflops)
  monkeypatch.setattr("jax.devices", lambda *a: [nvl])
  from jaxzero.models import lora  # pylint: disable=import-outside-toplevel
  m = cfg.model
  adapter_count = lora.n_adapter_params(lora.adapter_specs(
      m, cfg.lora.rank, lora.resolve_targets(cfg.lora.targets)))  # the program's counts
  result = bench.add_rates({"step_time_s": 1.0, "devices": 1, "parameters": adapter_count,
                            "frozen_parameters": count_params(m)}, cfg)
  tokens = cfg.train.global_batch * cfg.train.seq_len
  adapters = result["model_tflops"] * 1e12 / tokens - 4 * count_params(m) - (
      12 * m.n_layers * m.dim * cfg.train.seq_len)
  assert 0 < adapters / 6 < 0.01 * count_params(m)  # rank-16 adapters: well under 1%
  assert result["mfu"] == pytest.approx(result["model_tflops"] / 835.0)


@pytest.mark.slow
def test_offload_bench_reports_every_figure(capsys):
  bench = load_script("offload_bench")
  code = bench.main(["--steps", "2", "--json", "--set", "model.dim=128",
                     "--set", "model.mlp_dim=384", "--set", "model.n_layers=2"])
  assert code == 0
  result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  for key in ("state_bytes", "host_peak_bytes", "host_transient_bytes", "device_peak_bytes",
              "step_s", "step_s_no_offload", "step_s_delayed", "host_update_s",
              "host_update_gbps", "host_copy_gbps", "host_math_gbps", "overlap_efficiency"):
    assert result[key] is not None and result[key] >= 0, key
  predicted = result["predicted"]
  assert predicted["host_process_bytes"] >= result["state_bytes"] > 0
  # 12 bytes a parameter: the fp32 master weight and Adam's two moments.
  assert result["state_bytes"] == 12 * result["n_params"]
  # (That a step adds no second copy of the state to the host's memory, the update being
  # in place, is tests/offload/test_host_offload.py's: every chunk's buffer is the same.)


@pytest.mark.parametrize("script, args, message", [
    ("offload_bench", ["--steps", "0"], "--steps=0 must be at least 1"),
    ("offload_bench", ["--config", "nope.py"], "config file 'nope.py' does not exist"),
    ("checkpoint_bench", ["--saves", "0"], "--saves=0 must be at least 1"),
    ("checkpoint_bench", ["--config", "nope.py"], "config file 'nope.py' does not exist"),
])
def test_the_benchmarks_say_bad_input_in_one_line_before_measuring(script, args, message,
                                                                   capsys):
  try:
    code = load_script(script).main(args)
  except SystemExit as e:  # argparse's own
    code = e.code
  err = capsys.readouterr().err.strip()
  assert code == 2 and len(err.splitlines()) == 1 and message in err, err
  assert "host_copy_gbps" not in err  # nothing measured first
