"""Operating a run: the memory check, the banner and config.json, plain log lines,
per-step metrics, TensorBoard, evaluation, and the rough edges (a finished run,
--resume-step, Ctrl-C, the launcher's hint, gloo's chatter, the exported tokenizer)."""

import collections
import contextlib
import dataclasses
import io
import json
import logging
import shutil
import signal
import subprocess
import sys
import time
import warnings

import jax
import numpy as np
import pytest

from jaxzero import config, launch, plan
from jaxzero import train as train_cli
from jaxzero.errors import UserError
from jaxzero.models import trainable
from jaxzero.data import pipeline
from jaxzero.planning import memory_check, planner
from jaxzero.parallel import mesh as mesh_lib
from jaxzero.training import banner, evaluation, loop

from processes import ROOT, TINY, child_env, run_python

SMALL = ["model.dim=64", "model.n_layers=2", "model.mlp_dim=128", "train.seq_len=32",
         "train.global_batch=16", "train.grad_accum=2", "train.lr=3e-3", "train.warmup_steps=2",
         "train.steps=4", "train.log_every=2", "data.max_bytes=200000", "mesh.fsdp=8",
         "checkpoint.every=2", "eval.every=2", "eval.batches=2", "data.eval_fraction=0.1"]
STEPS = 4


def small(*sets):
  return config.load(TINY, [*SMALL, *sets])


Trained = collections.namedtuple("Trained", "workdir stdout outcome records warnings")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """A 4-step ZeRO-3 run on 8 devices with eval every 2 steps; its stdout and outcome."""
  workdir = tmp_path_factory.mktemp("run")
  out = io.StringIO()  # not a terminal: plain lines, as in a cluster's log
  warned = WarningsKept()
  logging.getLogger().addHandler(warned)
  try:
    with contextlib.redirect_stdout(out), warnings.catch_warnings(record=True) as python_warnings:
      warnings.simplefilter("always")
      outcome = loop.run_training(small(), workdir, devices=jax.devices()[:8], progress=True)
  finally:
    logging.getLogger().removeHandler(warned)
  warned.kept += [str(w.message) for w in python_warnings]
  records = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
  return Trained(workdir, out.getvalue(), outcome, records, warned.kept)


class WarningsKept(logging.Handler):
  def __init__(self):
    super().__init__(level=logging.WARNING)
    self.kept = []

  def emit(self, record):
    self.kept.append(record.getMessage())


# ----------------------------------------------------------------------------- memory check


@pytest.mark.slow
def test_llama8b_on_this_cpu_is_refused_in_one_line_before_allocating(tmp_path):
  started = time.monotonic()
  result = run_python("-m", "jaxzero.train", "--config", str(ROOT / "configs/llama8b_zero3.py"),
                      "--workdir", str(tmp_path / "w"), env=child_env(alone=True), timeout=60)
  assert time.monotonic() - started < 30
  assert result.returncode == 2, result.stderr
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
  # mesh.fsdp=-1 means 8 devices, as it does to jaxzero.plan; the state is 16Φ/8.
  assert lines[0].startswith("jaxzero.train: error: this run needs about ")
  assert "GB per device (model state 16.1 GB + activations" in lines[0]
  assert "on 8 devices, but 8 CPU devices share this host's" in lines[0]
  assert "remat.policy=full" in lines[0] and "--force starts it anyway" in lines[0]
  assert not (tmp_path / "w" / "checkpoints").exists()
  assert not (tmp_path / "w" / "config.json").exists()


def test_plan_and_train_resolve_minus_one_alike(monkeypatch):
  minus_one = config.MeshConfig(replica=1, fsdp=-1)
  assert mesh_lib.devices_for(minus_one, {}) == plan.DEFAULT_DEVICES == 8
  assert mesh_lib.devices_for(minus_one, {"JAX_NUM_CPU_DEVICES": "4"}) == 4
  assert mesh_lib.devices_for(config.MeshConfig(replica=2, fsdp=2), {}) == 4
  planned = []
  monkeypatch.delenv("JAX_NUM_CPU_DEVICES", raising=False)
  monkeypatch.setattr(planner, "plan", lambda cfg, n, *a, **k: planned.append(n) or 1 / 0)
  with pytest.raises(ZeroDivisionError):
    plan.main(["--config", TINY, "--set", "mesh.fsdp=-1"])
  assert planned == [8]  # what jaxzero.train's CLI asks JAX for (cli.load_config)


def test_the_check_names_what_fits_and_force_goes_on():
  from jaxzero import engine as engine_lib
  from jaxzero.models.llama import count_params
  from jaxzero.parallel.zero import Layout
  from jaxzero.runners.base import InMemoryRunner
  cfg = config.load(str(ROOT / "configs/llama8b_zero3.py"), ["zero.stage=1"])
  mesh = mesh_lib.make_mesh(1, 8, jax.devices()[:8])
  program = engine_lib.TrainProgram(cfg, Layout.from_config(cfg, mesh), trainable.llama(cfg.model))
  runner = InMemoryRunner(program)
  budget = memory_check.budget(runner, jax.devices()[:8])
  phi = count_params(cfg.model)
  assert budget.params == 2 * phi and budget.grads == 2 * phi  # bf16, replicated at stage 1
  assert budget.optimizer == pytest.approx(12 * phi / 8, rel=1e-6)  # 12Φ/N
  with pytest.raises(memory_check.DoesNotFitError):
    memory_check.check(runner, jax.devices()[:8])
  assert not memory_check.check(runner, jax.devices()[:8], force=True).fits
  # On 40 GB devices ZeRO-3 (16Φ/8 = 16 GB + activations) fits where stage 1 (~45 GB) does not.
  gpu = dataclasses.replace(budget, available=40 * 10**9, platform="gpu")
  assert not gpu.fits
  assert memory_check.suggest(program, gpu).startswith("what would fit: zero.stage=3 (~")


@pytest.mark.slow
def test_the_tiny_default_starts_without_a_warning(run):
  _, stdout, outcome, _, warned = run
  assert outcome.step == STEPS
  assert warned == [] and "warning" not in stdout.lower()


# ----------------------------------------------------------------------------- banner, logs


def test_banner_and_config_json(run):
  workdir, stdout, _, _, _ = run
  banner = stdout.split("\nstep ")[0]
  assert banner.startswith("jaxzero.train: Llama, ")
  assert "mesh      replica 1 x fsdp 8" in banner
  assert "= 8 virtual CPU devices (no GPU here), 1 process" in banner
  assert "stage 3 (FULL_SHARD)" in banner and "remat none" in banner
  assert ("micro-batch 1 x grad_accum 2 x 8 data-parallel = global batch 16 sequences of 32 = "
          "512 tokens per step") in banner
  assert "training tokens; 4 steps see 2,048 tokens" in banner
  assert "memory    per device: model state" in banner
  saved = json.loads((workdir / "config.json").read_text())
  assert saved == json.loads(json.dumps(dataclasses.asdict(small())))
  assert saved["eval"] == {"every": 2, "batches": 2}


def test_the_banner_states_the_host_memory_of_an_offloaded_run_on_a_gpu():
  budget = memory_check.Budget(params=16 << 30, grads=16 << 30, optimizer=96 << 30,
                               host=96 << 30, activations=4 << 30, available=112 << 30,
                               where="", devices=1, platform="gpu", host_process=97 << 30,
                               host_processes=2, host_ram=256 << 30)
  assert banner.host_line(budget) == (
      "  host      per process: 104.2 GB (offloaded state, the update's workspace, XLA's "
      "pinned pool, a save's copy of the device state) x 2 on this host = 208.3 GB of 274.9 GB "
      "RAM")
  assert banner.host_line(dataclasses.replace(budget, platform="cpu")) == ""
  assert banner.host_line(dataclasses.replace(budget, host_process=0)) == ""


def test_print_config_prints_the_resolved_config_and_exits(capsys):
  assert train_cli.main(["--config", TINY, "--set", "eval.every=3", "--set",
                         "data.eval_fraction=0.5", "--print-config"]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert {"eval.every=3  # --set", "eval.batches=4  # base", "data.eval_fraction=0.5  # --set",
          "data.eval_source=  # base"} <= set(lines)
  # What the file changes from the base config is the file's.
  assert {f"model.n_layers=4  # {TINY}", f"train.steps=80  # {TINY}",
          "zero.min_shard_size=100000  # base"} <= set(lines)


def test_print_config_names_who_named_a_strategy_that_a_stage_replaces(capsys, tmp_path):
  """zero.strategy decides zero.hybrid; a later --set zero.stage spells the strategy out,
  and the hybrid flag is the strategy's origin's (an earlier --set's, the config file's),
  not the base's."""
  assert train_cli.main(["--config", TINY, "--set", "zero.strategy=HYBRID_SHARD", "--set",
                         "zero.stage=1", "--print-config"]) == 0
  lines = set(capsys.readouterr().out.splitlines())
  assert {"zero.stage=1  # --set", "zero.hybrid=True  # --set",
          "zero.strategy=  # --set zero.stage replaces HYBRID_SHARD (--set)"} <= lines, lines
  preset = tmp_path / "hybrid.py"
  preset.write_text("import dataclasses\nfrom jaxzero import config\n\ndef get_config():\n"
                    f"  c = config.read({TINY!r})\n  return dataclasses.replace(c, zero="
                    "dataclasses.replace(c.zero, strategy='HYBRID_SHARD'))\n")
  assert train_cli.main(["--config", str(preset), "--set", "zero.stage=1",
                         "--print-config"]) == 0
  lines = set(capsys.readouterr().out.splitlines())
  assert {"zero.stage=1  # --set", f"zero.hybrid=True  # {preset}",
          f"zero.strategy=  # --set zero.stage replaces HYBRID_SHARD ({preset})"} <= lines


def test_print_config_into_a_closed_pipe_is_no_traceback(capsys, monkeypatch):
  """`--print-config | head -2`: the reader leaves; the exit is SIGPIPE's status, quiet."""
  import os  # pylint: disable=import-outside-toplevel

  class ClosedPipe(io.StringIO):
    def write(self, text):
      raise BrokenPipeError(32, "Broken pipe")

    def fileno(self):
      return 1
  monkeypatch.setattr(sys, "stdout", ClosedPipe())
  redirected = []
  monkeypatch.setattr(os, "dup2", lambda fd, to: redirected.append(to))
  assert train_cli.main(["--config", TINY, "--print-config"]) == 141
  assert redirected == [1]  # stdout, to devnull: the exit's flush does not fail again


@pytest.mark.slow
def test_a_reader_of_stdout_that_leaves_mid_run_does_not_end_it(tmp_path, capsys, monkeypatch):
  """`jaxzero.train ... | head -3`, or a log shipper that dies: the run goes on to its end
  and saves (it exited 141 unsaved; under several processes it hung, process 0 gone from
  a collective the others waited in)."""
  import os  # pylint: disable=import-outside-toplevel

  class HeadOfThree(io.StringIO):
    lines = 0

    def write(self, text):
      self.lines += text.count("\n")
      if self.lines > 3:
        raise BrokenPipeError(32, "Broken pipe")
      return super().write(text)

    def fileno(self):
      return 1
  redirected = []
  monkeypatch.setattr(sys, "stdout", HeadOfThree())
  monkeypatch.setattr(os, "dup2", lambda fd, to: redirected.append(to))
  assert train_cli.main(["--config", TINY, *[f"--set={s}" for s in SMALL],
                         "--set=eval.every=0", "--set=checkpoint.every=0", "--no-progress",
                         "--workdir", str(tmp_path / "w")]) == 0
  assert redirected == [1] and "stdout's reader has gone; training goes on" in \
      capsys.readouterr().err
  assert (tmp_path / "w" / "checkpoints" / str(STEPS)).is_dir()


def test_print_config_quotes_a_value_the_shell_would_split(capsys, tmp_path):
  source = tmp_path / "my corpus.txt"
  source.write_text("some text " * 100)
  assert train_cli.main(["--config", TINY, "--set", f"data.source={source}",
                         "--print-config"]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert f"'data.source={source}'  # --set" in lines


def test_plain_lines_per_logged_step_and_per_step_metrics(run):
  _, stdout, _, records, _ = run
  assert [r["step"] for r in records] == [1, 2, 3, 4]
  lines = [l for l in stdout.splitlines() if l.startswith("step ")]
  assert [l.split(" | ")[0] for l in lines] == ["step 0/4", "step 2/4", "step 4/4"]
  for line, r in zip(lines[1:], (records[1], records[3])):  # train.log_every=2
    assert f"loss {r['loss']:.4f}" in line and f"grad norm {r['grad_norm']:.3f}" in line
    assert f"lr {r['lr']:.2e}" in line and f"{r['tokens_per_sec']:,.0f} tok/s" in line
    assert "TFLOP/s" in line and "host mem" in line
    assert f"eval loss {r['eval_loss']:.4f}" in line
  times = [r["step_time_s"] for r in records]
  assert len(set(times)) == 4  # each step's own time, not a window's average
  for r in records:
    assert r["tokens_per_sec"] == pytest.approx(512 / r["step_time_s"])
  assert "host_rss_bytes" in records[1] and "host_rss_bytes" not in records[0]


def test_tensorboard_events_hold_loss_and_eval_loss(run):
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
  workdir, _, _, records, _ = run
  events = EventAccumulator(str(workdir / "tb"))
  events.Reload()
  loss = {e.step: e.value for e in events.Scalars("train/loss")}
  eval_loss = {e.step: e.value for e in events.Scalars("eval/loss")}
  np.testing.assert_allclose([loss[s] for s in (1, 2, 3, 4)], [r["loss"] for r in records],
                             rtol=1e-6)
  assert sorted(eval_loss) == [0, 2, 4]
  np.testing.assert_allclose([eval_loss[2], eval_loss[4]],
                             [records[1]["eval_loss"], records[3]["eval_loss"]], rtol=1e-6)
  assert {"train/grad_norm", "train/lr", "perf/tokens_per_sec", "memory/host_rss_bytes",
          "eval/perplexity"} <= set(events.Tags()["scalars"])


@pytest.mark.slow
def test_the_tensorboard_writer_loads_without_importing_torch(tmp_path):
  """tensorboardX imports torch when it can (over a second at each start);
  jaxzero's writer does without it, and torch stays importable afterwards."""
  code = ("import pathlib, sys; from jaxzero.training import metrics; "
          "logger = metrics.MetricsLogger(pathlib.Path(sys.argv[1]), 1, progress=False); "
          "logger.log([dict(step=1, loss=2.5, grad_norm=1.0, lr=1e-3, tokens_per_sec=9.0, "
          "step_time_s=1.0, tflops=0.1)]); logger.close(); "
          "assert 'torch' not in sys.modules, 'torch imported'; import torch")
  result = run_python("-c", code, str(tmp_path), timeout=120)
  assert result.returncode == 0, result.stderr[-3000:]
  assert list((tmp_path / "tb").iterdir())

# ----------------------------------------------------------------------------- evaluation


@pytest.fixture(scope="module")
def stage_evals(run):
  """{layout: eval loss of the run's step-2 checkpoint} for stages 0-2, HYBRID_SHARD on
  a 2 x 4 mesh and stage 3 with the weights in pinned_host (streamed a layer at a time),
  each read into its own layout."""
  from jaxzero.checkpoint import checkpointer as checkpoint_lib
  losses = {}
  for name, sets in (("stage 0", ["zero.stage=0"]), ("stage 1", ["zero.stage=1"]),
                     ("stage 2", ["zero.stage=2"]),
                     ("hybrid 2x4", ["zero.strategy=HYBRID_SHARD", "mesh.replica=2",
                                     "mesh.fsdp=4"]),
                     ("stage 3, weights in pinned_host", ["zero.stage=3",
                                                          "offload.params=pinned_host"])):
    cfg = small(*sets)
    built = loop.build(cfg, jax.devices()[:8])
    abstract = built.program.abstract_state()
    evaluate = evaluation.Evaluator(built.program, built.eval_batches, abstract)
    with checkpoint_lib.Checkpointer(run.workdir, 3, checkpoint_lib.run_info(
        cfg.model, cfg.precision.compute, cfg.seed)) as checkpoints:
      losses[name] = evaluate(checkpoints.restore(2, abstract))["eval_loss"]
  return losses


@pytest.mark.slow
def test_eval_loss_is_the_same_under_every_stage_and_mesh(run, stage_evals):
  records = run.records  # stage 3 on 1 x 8, evaluated in the loop
  assert len(stage_evals) == 5
  for name, loss in stage_evals.items():
    np.testing.assert_allclose(loss, records[1]["eval_loss"], rtol=1e-5, err_msg=name)


def test_eval_loss_falls_with_training(run):
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
  workdir, stdout, _, records, _ = run
  events = EventAccumulator(str(workdir / "tb"))
  events.Reload()
  eval_loss = {e.step: e.value for e in events.Scalars("eval/loss")}
  before, after = eval_loss[0], records[3]["eval_loss"]  # step 0: before any update
  assert f"step 0/4 | eval loss {before:.4f}" in stdout
  assert after < before - 0.3, (before, after)
  assert records[3]["eval_perplexity"] == pytest.approx(np.exp(after))


def test_eval_batches_are_fixed_windows_of_the_held_out_tail():
  tokens = np.arange(1000, dtype=np.uint16)
  train, held_out = pipeline.split(tokens, config.DataConfig(eval_fraction=0.1))
  assert train.size == 900 and held_out[0] == 900
  batches = pipeline.EvalBatches(held_out, n_batches=2, rows=3, seq_len=8, what="x")
  full = batches()
  assert full.shape == (2, 3, 9)
  np.testing.assert_array_equal(full[0, 1], np.arange(908, 917))
  np.testing.assert_array_equal(batches(0, slice(1, 3)), full[:, 1:3])


def test_eval_settings_are_checked():
  with pytest.raises(config.ConfigError, match="eval.every=5 needs a held-out split"):
    config.load(TINY, ["eval.every=5"])
  with pytest.raises(config.ConfigError, match=r"data.eval_fraction=1.0 must be in \[0, 1\)"):
    config.load(TINY, ["data.eval_fraction=1.0"])


# ----------------------------------------------------------------------------- rough edges


def test_a_finished_run_says_so_and_how_to_go_on(run):
  workdir, _, _, _, _ = run
  outcome = loop.run_training(small(), workdir, devices=jax.devices()[:8], progress=False)
  assert outcome.finished and outcome.step == STEPS and not outcome.history
  message = train_cli.summary(outcome, workdir, None, STEPS)
  assert message.startswith(f"nothing to do: {workdir} is already at step 4 (train.steps=4)")
  assert "--set train.steps=N" in message


def test_resume_step_goes_back_to_an_earlier_checkpoint(run, tmp_path):
  workdir = tmp_path / "w"
  shutil.copytree(run.workdir, workdir)
  # Up to step 2 only, so nothing is compiled: the state of checkpoint 2 is kept.
  outcome = loop.run_training(small(), workdir, steps=2, devices=jax.devices()[:8],
                                 progress=False, resume_step=2)
  assert (outcome.start_step, outcome.step, outcome.finished) == (2, 2, True)
  assert (workdir / "checkpoints.damaged" / "4").is_dir()  # set aside, not deleted
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()) == ["2"]
  steps = [json.loads(l)["step"] for l in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert steps == [1, 2]
  dropped = (workdir / "metrics.dropped.jsonl").read_text().splitlines()
  assert [json.loads(l)["step"] for l in dropped] == [3, 4]  # the abandoned records kept


def test_a_resume_under_another_batch_or_split_says_where_the_data_goes_on(run, tmp_path,
                                                                          caplog):
  """A step's rows are found from the global batch, the sequence length and the split:
  under others the resumed run reads other rows (repeats or skips some), never unawares."""
  workdir = tmp_path / "w"
  shutil.copytree(run.workdir, workdir)
  global_batch = small().train.global_batch
  with caplog.at_level(logging.WARNING):
    loop.run_training(small(f"train.global_batch={2 * global_batch}"), workdir, steps=2,
                      devices=jax.devices()[:8], progress=False, resume_step=2)
  assert (f"was trained with train.global_batch={global_batch} (now {2 * global_batch}): the "
          "steps from here on read other rows") in caplog.text


@pytest.mark.slow
def test_a_saving_step_does_not_slow_the_next_step_s_figures(run, tmp_path, monkeypatch,
                                                             capsys):
  """The blocking part of an asynchronous save (here 5 s) is no step's time: the step after
  a save shows the step's own speed in tokens/s and MFU. (The memory line names the
  resumed run's first step.)"""
  from jaxzero.checkpoint import checkpointer
  real_save = checkpointer.Checkpointer.save

  def slow_save(self, step, state, **kw):
    time.sleep(5)
    return real_save(self, step, state, **kw)
  monkeypatch.setattr(checkpointer.Checkpointer, "save", slow_save)
  workdir = tmp_path / "w"
  shutil.copytree(run.workdir, workdir)
  loop.run_training(small(), workdir, steps=6, devices=jax.devices()[:8], progress=False,
                    resume_step=2)  # saves 4 (during the run) and 6 (at its end)
  records = {r["step"]: r for r in map(json.loads, (workdir / "metrics.jsonl").open())}
  assert sorted(records) == [1, 2, 3, 4, 5, 6]
  assert records[5]["step_time_s"] < 2.5, records[5]
  assert "memory_ratio" in records[3]
  assert "memory after step 3, per device:" in capsys.readouterr().out


def test_a_resume_step_with_no_checkpoint_is_refused_before_the_build(run, tmp_path,
                                                                        monkeypatch):
  workdir = tmp_path / "w"
  shutil.copytree(run.workdir, workdir)
  monkeypatch.setattr(loop, "build", lambda *a, **k: pytest.fail("built"))
  with pytest.raises(UserError, match="--resume-step 3: no such checkpoint.*steps: 2, 4"):
    loop.run_training(small(), workdir, devices=jax.devices()[:8], resume_step=3)


@pytest.mark.slow
def test_ctrl_c_during_start_up_is_one_quiet_line(tmp_path):
  proc = subprocess.Popen(
      [sys.executable, "-m", "jaxzero.train", "--config", TINY, "--workdir", str(tmp_path)],
      cwd=ROOT, env=child_env(alone=True), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
      text=True)
  time.sleep(3)  # importing JAX, building the run or compiling
  proc.send_signal(signal.SIGINT)
  _, err = proc.communicate(timeout=60)
  assert proc.returncode == 130, err
  assert "Traceback" not in err and "KeyboardInterrupt" not in err
  assert err.strip().splitlines()[-1].startswith("jaxzero.train: interrupted")


def test_launch_without_dashes_gives_its_own_hint(capsys):
  with pytest.raises(SystemExit) as exit_:
    launch.main(["--nproc", "2", "--config", TINY])
  assert exit_.value.code == 2
  (line,) = capsys.readouterr().err.strip().splitlines()
  assert line == (f"jaxzero.launch: error: --config {TINY} is not a jaxzero.launch argument; "
                  "put the jaxzero.train arguments after --, e.g. -- --config "
                  "configs/tiny_zero3.py")


def test_launch_drops_gloo_chatter():
  chatter = ("[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected peer "
             "ranks is : 1")
  sink = io.StringIO()
  launch._pump(io.StringIO(f"{chatter}\nstep 1{chatter}/4\nlast\n"), sink, "[0] ", None)
  assert sink.getvalue() == "[0] step 1/4\n[0] last\n"


def test_export_copies_the_run_tokenizer(tmp_path):
  tokenizers = pytest.importorskip("tokenizers")
  transformers = pytest.importorskip("transformers")
  from jaxzero.hf import metadata
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(
      {"<unk>": 0, "</s>": 1, "hello": 2, "world": 3}, unk_token="<unk>"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  (tmp_path / "tok").mkdir()
  tok.save(str(tmp_path / "tok" / "tokenizer.json"))
  workdir, out = tmp_path / "run", tmp_path / "hf"
  workdir.mkdir()
  out.mkdir()
  data = dataclasses.replace(config.DataConfig(), tokenizer=str(tmp_path / "tok"))
  (workdir / "config.json").write_text(json.dumps({"data": dataclasses.asdict(data)}))
  assert metadata.copy_tokenizer(metadata.read_run(workdir), out) == [
      "tokenizer.json", "tokenizer_config.json"]
  loaded = transformers.AutoTokenizer.from_pretrained(str(out))
  assert loaded("hello world")["input_ids"] == [2, 3]
  byte_run = tmp_path / "byte"
  byte_run.mkdir()
  (byte_run / "config.json").write_text(
      json.dumps({"data": dataclasses.asdict(config.DataConfig())}))
  assert metadata.copy_tokenizer(metadata.read_run(byte_run), out) == []


def test_on_a_terminal_the_bar_shows_logged_steps(tmp_path, monkeypatch, capsys):
  from jaxzero.training import metrics
  monkeypatch.setattr(metrics, "use_progress_bar", lambda progress: progress)
  logger = metrics.MetricsLogger(tmp_path, total_steps=2, progress=True, tensorboard=False)
  logger.log_initial_eval({"eval_loss": 2.0, "eval_perplexity": 7.39})
  record = {"step": 2, "loss": 1.5, "grad_norm": 0.5, "lr": 1e-3, "step_time_s": 0.5,
            "tokens_per_sec": 1000.0, "tflops": 0.1, "eval_loss": 1.25, "eval_perplexity": 3.49}
  logger.log([dict(record, step=1), record])
  logger.close()
  captured = capsys.readouterr()
  assert captured.out == "step 0/2 | eval loss 2.0000 (ppl 7.39)\n"  # above the bar
  assert "2/2" in captured.err and "step 2/2 |" not in captured.err + captured.out
  assert "loss=1.5000" in captured.err and "eval=1.2500" in captured.err
  steps = [json.loads(l)["step"] for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert steps == [1, 2]


def test_a_ds_config_tensorboard_block_is_accepted():
  from jaxzero.frameworks import deepspeed
  ds = {"train_batch_size": 16, "tensorboard": {"enabled": True, "output_path": "logs/"}}
  assert deepspeed.translate(ds, config.base()).unneeded == {
      "tensorboard": "jaxzero always writes TensorBoard events to WORKDIR/tb/"}


def test_eval_source_is_tokenized_like_the_training_data(tmp_path):
  (tmp_path / "held_out.txt").write_text("held out text " * 20)
  data = config.DataConfig(eval_source=str(tmp_path / "held_out.txt"))
  cfg = dataclasses.replace(config.base(), data=data)
  tokens = pipeline.open_data(cfg, tmp_path / "run", rows=1, progress=False).held_out.tokens
  assert bytes(np.asarray(tokens)) == b"held out text " * 20 + b"\0"  # bytes, then the separator


def test_a_profile_window_is_cut_to_the_steps_the_run_trains(tmp_path):
  """A resumed run past START traces from its first step, a --steps short of END to its
  last; a window the run never reaches says so instead of tracing nothing in silence."""
  from jaxzero.training import profiling
  cut = profiling.StepProfiler((3, 5), tmp_path, first=4, last=10)
  assert cut.window == (4, 5)
  assert cut.note == "profile.steps=3:5: this run trains steps 4-10; tracing 4-5"
  missed = profiling.StepProfiler((3, 5), tmp_path, first=6, last=10)
  assert missed.window is None and "none of them; nothing is traced" in missed.note
  whole = profiling.StepProfiler((3, 5), tmp_path, first=1, last=10)
  assert (whole.window, whole.note) == ((3, 5), None)
  assert profiling.StepProfiler(None, tmp_path, first=1, last=10).note is None


def test_the_banner_says_which_of_the_state_each_stage_shards():
  import types
  from jaxzero.parallel.zero import SHARDED_ROLES
  layouts = {stage: types.SimpleNamespace(shard_size=4, is_sharded=lambda role, stage=stage:
                                          role in SHARDED_ROLES[stage]) for stage in range(4)}
  # pylint: disable-next=protected-access
  assert [banner._sharded_text(layouts[s]) for s in range(4)] == [
      "state replicated on every data-parallel device", "optimizer state sharded over 4 devices",
      "optimizer state and gradients sharded over 4 devices", "state sharded over 4 devices"]
