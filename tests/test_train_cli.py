"""`python -m jaxzero.train`: bad input is one clear line and exit code 2; a short run works."""

import json

import pytest

from jaxzero import plan, train

from processes import ROOT, TINY, child_env, run_python


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
      "--set", "model.dim=36", "--set", "model.n_heads=2", "--set", "model.mlp_dim=72"],
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


def exit_code(main, argv) -> int:
  """main(argv)'s exit code, also where its parser exits (argparse's way)."""
  try:
    return main(argv)
  except SystemExit as e:
    return e.code


@pytest.mark.parametrize("args, message", [
    (["--config", "{tmp}/cfg.json"], "config file '{tmp}/cfg.json' is not a Python file: a "
     "config is a .py file defining get_config() (presets are in configs/); a DeepSpeed config "
     "(JSON) goes to jaxzero.train --deepspeed, over such a file"),
    (["--config", str(ROOT / "configs")], "is a directory; name a .py file in it: "),
    (["--config", TINY, "--steps", "81"], "--steps=81 is past train.steps=80, where the "
     "learning-rate schedule ends; raise train.steps (--set train.steps=81) to train that far"),
    (["--config", TINY, "--workdir", ""], "--workdir is empty; name a directory, or leave "
     "--workdir out for runs/tiny_zero3"),
    (["--config", TINY, "--set", "model.dim=132"], "is a head dimension of 33"),
    (["--config", TINY, "--set", "train.weight_decay=nan"],
     "train.weight_decay=nan must be a finite number"),
    (["--config", TINY, "--set", "model.attention=cudnn"], "model.attention=cudnn needs a GPU "
     "(cuDNN); these devices are cpu: use model.attention=auto (cuDNN where it can run) or "
     "blockwise"),
    (["--config", TINY, "--resume-step", "4", "--steps", "2"], "--steps=2 is before "
     "--resume-step=4: nothing would be trained; train to a step at or past the one resumed "
     "from"),
    (["--config", TINY, "--resume-step", "90"], "train.steps=80 is before --resume-step=90"),
])
def test_bad_input_is_one_line_before_anything_runs(args, message, tmp_path, capsys):
  (tmp_path / "cfg.json").write_text('{"train_batch_size": 32}')
  args = [a.replace("{tmp}", str(tmp_path)) for a in args]
  code = exit_code(train.main, ["--workdir", str(tmp_path / "w"), *args])  # the last one counts
  errors = capsys.readouterr().err.strip().splitlines()
  assert code == 2 and len(errors) == 1, errors
  assert errors[0].startswith("jaxzero.train: error: ")
  assert message.replace("{tmp}", str(tmp_path)) in errors[0], errors
  assert not (tmp_path / "w").exists()


def test_plan_refuses_a_config_that_is_not_python(tmp_path, capsys):
  (tmp_path / "fsdp.yaml").write_text("distributed_type: FSDP\n")
  assert plan.main(["--config", str(tmp_path / "fsdp.yaml")]) == 2
  errors = capsys.readouterr().err.strip().splitlines()
  assert len(errors) == 1 and "goes to jaxzero.train --accelerate-config" in errors[0], errors


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
