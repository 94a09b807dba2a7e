"""The README's first command on any machine: the embedded default takes every device there
is (here 1, 2 and 8 CPU devices; on a GPU machine its GPUs) and says which."""

import json

import pytest

from processes import TINY, child_env, run_python


@pytest.mark.slow
@pytest.mark.parametrize("devices", [1, 2, 8])
def test_the_embedded_default_trains_on_the_devices_there_are(devices, tmp_path):
  result = run_python("-m", "jaxzero.train", "--config", TINY, "--workdir", str(tmp_path / "w"),
                      "--steps", "2", "--no-progress", "--set", "train.log_every=1",
                      "--set", "data.max_bytes=200000",
                      env=child_env(alone=True, JAX_NUM_CPU_DEVICES=str(devices)))
  assert result.returncode == 0, result.stderr[-3000:]
  plural = "s" if devices > 1 else ""
  assert (f"mesh      replica 1 x fsdp {devices} x tensor 1 = {devices} virtual CPU "
          f"device{plural} (no GPU here)") in result.stdout, result.stdout
  records = [json.loads(line) for line in (tmp_path / "w" / "metrics.jsonl").read_text()
             .splitlines()]
  assert [r["step"] for r in records] == [1, 2]
