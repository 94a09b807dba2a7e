"""`python -m jaxzero.train`: bad input is one clear line and exit code 2; a short run works."""

import json

import pytest

from processes import TINY, child_env, run_python


@pytest.mark.slow
def test_print_config_gives_every_key_as_a_set_argument():
  result = run_python("-m", "jaxzero.train", "--config", TINY, "--set", "zero.stage=2",
                      "--print-config")
  assert result.returncode == 0, result.stderr
  lines = [line.split("  # ")[0] for line in result.stdout.splitlines()]  # then the origin
  assert "zero.stage=2" in lines and "train.steps=80" in lines and "init.hf_checkpoint=" in lines
  from jaxzero import config  # pylint: disable=import-outside-toplevel
  assert config.apply_overrides(config.load(TINY), lines) == config.load(TINY, ["zero.stage=2"])


@pytest.mark.parametrize("args, message", [
    (["--config", TINY, "--set", "train.stepz=3"],
     "unknown config key 'train.stepz'; valid keys here: train.steps"),
    (["--config", TINY, "--set", "zero.stage=5"],
     "zero.stage='5' is not valid; choose one of: 0, 1, 2, 3"),
    (["--config", TINY, "--set", "mesh.replica=3", "--set", "mesh.fsdp=-1"],
     "mesh.replica=3 x mesh.fsdp=-1 does not fit 8 devices; the product must equal"),
    (["--config", TINY, "--set", "train.global_batch=36"],
     "train.global_batch=36 is not divisible by data-parallel devices (8) x train.grad_accum (2)"),
    (["--config", "configs/nope.py"],
     "config file 'configs/nope.py' does not exist; presets are in configs/: "),
    (["--config", TINY, "--set", "data.source=/no/such/file.txt"],
     "data.source='/no/such/file.txt' is neither 'stdlib' nor a file, directory or glob"),
    (["--config", TINY, "--steps", "0"], "--steps=0 must be at least 1"),
    (["--config", TINY, "--set", "offload.optimizer=pinned_host",
      "--set", "offload.optimizer_fraction=1.5"],
     "offload.optimizer_fraction=1.5 must be between 0 and 1"),
    (["--config", TINY, "--set", "offload.optimizer=pinned_host",
      "--set", "offload.delayed_update=true", "--set", "precision.compute=float16"],
     "offload.delayed_update=true with precision.compute=float16"),
    (["--config", TINY, "--set", "lora.rank=0", "--set", "lora.init_from=/x"],
     "lora.init_from=/x needs lora.rank"),
    (["--config", TINY, "--set", "lora.rank=8", "--set", "lora.targets=qq"],
     "lora.targets='qq' matches no projection"),
    (["--config", TINY, "--set", "lora.rank=8", "--set", "lora.base_dtype=nf4",
      "--set", "model.dim=36", "--set", "model.mlp_dim=72"],
     "not a multiple of the 64-value block"),
    (["--config", TINY, "--set", "lora.rank=8", "--set", "lora.init_from=/no/adapter"],
     "lora.init_from=/no/adapter: adapter_config.json is missing"),
    (["--config", TINY, "--set", "data.format=chat"],
     "data.format='chat' reads records from .jsonl or .parquet files; set data.source"),
    (["--config", TINY, "--set", "data.format=sharegpt"],
     "data.format='sharegpt'; choose one of text, chat, prompt_completion"),
])
@pytest.mark.slow
def test_bad_input_is_one_line_and_exit_code_2(args, message, tmp_path):
  result = run_python("-m", "jaxzero.train", *args, "--workdir", str(tmp_path / "w"))
  assert result.returncode == 2, result.stderr
  errors = [line for line in result.stderr.splitlines() if "error" in line]
  assert len(errors) == 1 and message in errors[0], result.stderr
  assert "Traceback" not in result.stderr
  assert not (tmp_path / "w" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_short_run_writes_metrics_and_a_checkpoint_in_the_default_relative_workdir(tmp_path):
  # Run from tmp_path without --workdir: the default is runs/<config name>,
  # a relative path, which orbax only accepts once made absolute.
  result = run_python("-m", "jaxzero.train", "--config", TINY, "--steps", "3",
                      "--set", "train.log_every=1", "--set", "data.max_bytes=500000",
                      "--no-progress", cwd=tmp_path, env=child_env(pythonpath=True))
  assert result.returncode == 0, result.stderr
  workdir = tmp_path / "runs" / "tiny_zero3"
  records = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records] == [1, 2, 3]
  assert "trained to step 3" in result.stdout
  assert (workdir / "checkpoints" / "3").is_dir()
