"""Watching a run: Weights & Biases (offline, read back from its own files), a
profiler trace of chosen steps, and the memory plan against the first step."""

import glob
import gzip
import json
import struct

import jax
import pytest

from jaxzero import config
from jaxzero import train as train_cli
from jaxzero.errors import ConfigError
from jaxzero.frameworks import accelerate, deepspeed
from jaxzero.training import loop, tracking

from processes import TINY

pytestmark = pytest.mark.slow  # a run of 6 steps, resumed to 8

SETS = ["model.dim=64", "model.n_layers=2", "model.mlp_dim=128", "train.seq_len=32",
        "train.global_batch=16", "train.steps=8", "data.max_bytes=200000", "log.wandb=jaxzero-test",
        "log.wandb_mode=offline", "profile.steps=3:5"]


def wandb_history(workdir) -> dict[int, dict]:
  """{step: logged values} of every offline W&B run in `workdir`, read from the
  runs' .wandb files (LevelDB-log records of wandb's own protobuf Record)."""
  from wandb.proto import wandb_internal_pb2  # pylint: disable=import-outside-toplevel
  history = {}
  for path in sorted(glob.glob(str(workdir / "wandb" / "offline-run-*" / "run-*.wandb"))):
    data, pos, payload = open(path, "rb").read(), 7, b""  # past the ":W&B" header
    while pos + 7 <= len(data):
      if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
        pos += 32768 - pos % 32768
        continue
      length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
      payload += data[pos + 7:pos + 7 + length]
      pos += 7 + length
      if kind in (1, 4):  # a FULL record, or the LAST piece of one
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        payload = b""
        if record.WhichOneof("record_type") == "history":
          items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                   for i in record.history.item}
          history[items["_step"]] = items
  return history


@pytest.fixture(scope="module")
def watched(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("watched")
  first = loop.run_training(config.load(TINY, SETS), workdir, steps=6,
                            devices=jax.devices()[:8], progress=False)
  run_id = (workdir / tracking.RUN_ID_FILE).read_text()
  second = loop.run_training(config.load(TINY, SETS), workdir, devices=jax.devices()[:8],
                             progress=False)
  return workdir, first.history + second.history, run_id


def test_wandb_has_every_logged_steps_loss_and_a_resume_continues_the_run(watched):
  workdir, history, run_id = watched
  logged = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  got = wandb_history(workdir)
  assert sorted(got) == [r["step"] for r in logged] == list(range(1, 9))
  assert [got[r["step"]]["train/loss"] for r in logged] == [r["loss"] for r in logged]
  assert (workdir / tracking.RUN_ID_FILE).read_text() == run_id  # the same W&B run
  runs = glob.glob(str(workdir / "wandb" / "offline-run-*"))
  assert len(runs) == 2 and all(r.endswith("-" + run_id.strip()) for r in runs)


def test_a_profile_of_steps_3_to_5_opens_with_their_events(watched):
  workdir, _, _ = watched
  (trace,) = glob.glob(str(workdir / "profile" / "plugins" / "profile" / "*" /
                           "perfetto_trace.json.gz"))
  events = json.load(gzip.open(trace))
  events = events["traceEvents"] if isinstance(events, dict) else events
  steps = sorted(int(e["args"]["step_num"]) for e in events if e.get("name") == "train_step")
  assert steps == [3, 4, 5]
  assert any("train_step" in str(e.get("name", "")) and e.get("dur") for e in events)


def test_the_first_step_compares_measured_memory_with_the_plan(watched):
  _, history, _ = watched
  first = history[0]
  assert first["step"] == 1 and first["predicted_total_bytes"] > 0
  assert 0 < first["memory_ratio"] < float("inf") and first["measured_total_bytes"] > 0
  assert "RSS" in first["memory_measured_as"]  # labelled for what it is on a CPU
  assert all("memory_ratio" not in r for r in history[1:6])


def test_wandb_without_the_package_is_one_line_naming_the_extra(tmp_path, capsys, monkeypatch):
  real = tracking.importlib.util.find_spec
  monkeypatch.setattr(tracking.importlib.util, "find_spec",
                      lambda name, *a: None if name == "wandb" else real(name, *a))
  code = train_cli.main(["--config", TINY, "--set", "log.wandb=p", "--workdir",
                         str(tmp_path / "w")])
  assert code == 2
  assert capsys.readouterr().err.strip().splitlines() == [
      "jaxzero.train: error: log.wandb=p needs the wandb package: pip install 'jaxzero[wandb]' "
      "(or set log.wandb_mode=disabled)"]
  assert not (tmp_path / "w" / "checkpoints").exists()


def test_a_ds_config_wandb_block_translates_and_log_with_is_no_accelerate_config_key():
  base = config.load(TINY)
  tr = deepspeed.translate({"wandb": {"enabled": True, "project": "p", "group": "g",
                                      "team": "t"}}, base)
  log = tr.apply(base).log
  assert (log.wandb, log.wandb_group, log.wandb_entity) == ("p", "g", "t")
  assert deepspeed.translate({"wandb": {"enabled": False}}, base).apply(base).log == base.log
  # Accelerate's config file refuses log_with (an Accelerator argument), and so does this.
  yaml = "distributed_type: FSDP\nlog_with: wandb\n"
  with pytest.raises(ConfigError, match="log_with"):
    accelerate.translate(__import__("yaml").safe_load(yaml), base)


def test_a_step_that_returns_when_done_is_timed_as_itself(monkeypatch):
  # A runner that finishes each step before returning (the update on the host): step 1
  # takes 1 s, step 2 takes 2 s; both are logged at once. Each step's time is its own (the
  # last of a logging window was once ~0 s, and each other step had its successor's).
  from jaxzero.training import metrics as metrics_lib

  class Records:
    def log(self, records):
      self.records = records

  now = [0.0]
  monkeypatch.setattr(metrics_lib.time, "perf_counter", lambda: now[0])
  logger = Records()
  pending = metrics_lib.PendingMetrics(logger, 100, 6.0, jax.devices()[:1],
                                       returns_when_done=True)
  for step_end in (1.0, 3.0):
    now[0] = step_end  # the step ran until now, and returns its metrics ready
    pending.add({"loss": jax.block_until_ready(jax.numpy.float32(2.0))})
  pending.log(2)
  assert [r["step_time_s"] for r in logger.records] == [1.0, 2.0]
  assert [r["tokens_per_sec"] for r in logger.records] == [100.0, 50.0]
