"""The shape of the code, and the promises that survive changes to it.

* Public APIs only: no ``jax._src`` or ``orbax.checkpoint._src`` anywhere.
* One job per module: none grows past ~400 lines.
* A checkpoint written by an earlier jaxzero (tests/fixtures/checkpoint_v0_1,
  saved by the first release's ``jaxzero.train``) still resumes, and the next
  step gives the loss the earlier release computed.
"""

import pathlib
import re
import shutil

import jax
import numpy as np

from jaxzero import config
from jaxzero.training import loop

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = sorted(p for folder in ("jaxzero", "models", "scripts", "tests", "configs")
                 for p in (ROOT / folder).rglob("*.py"))
MAX_MODULE_LINES = 440  # "about 400": room for a docstring, not for a second job

# The settings the fixture was trained with (configs/tiny_zero3.py, smaller), and
# what the first release logged for step 3 when it resumed from step 2.
FIXTURE = ROOT / "tests" / "fixtures" / "checkpoint_v0_1"
FIXTURE_SETTINGS = ["model.dim=32", "model.n_layers=2", "model.mlp_dim=64", "model.n_heads=4",
                    "model.n_kv_heads=2", "train.global_batch=8", "train.grad_accum=1",
                    "train.seq_len=16", "train.steps=2", "data.max_bytes=100000",
                    "checkpoint.every=2"]
FIXTURE_STEP3 = {"loss": 5.4413743019104, "grad_norm": 1.8503363132476807}


def test_no_private_jax_or_orbax_api():
  private = re.compile(r"\b(jax|orbax\.checkpoint)\._src\b|from (jax|orbax\.checkpoint) import _src")
  offenders = [f"{p.relative_to(ROOT)}:{i}" for p in SOURCES
               for i, line in enumerate(p.read_text().splitlines(), 1)
               if private.search(line) and p.name != "test_architecture.py"]
  assert not offenders, offenders


def test_no_module_is_a_grab_bag():
  library = [p for p in SOURCES if p.parts[-2] in ("jaxzero", "models")]
  long = {str(p.relative_to(ROOT)): n for p in library
          if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
  assert not long, long


def test_a_checkpoint_from_the_first_release_still_resumes(tmp_path):
  shutil.copytree(FIXTURE, tmp_path / "checkpoints")
  cfg = config.load(str(ROOT / "configs" / "tiny_zero3.py"), FIXTURE_SETTINGS)
  outcome = loop.run_training(cfg, tmp_path, steps=3, devices=jax.devices()[:8],
                                 progress=False)
  assert outcome.start_step == 2
  (step3,) = outcome.history
  assert step3["step"] == 3
  np.testing.assert_allclose([step3["loss"], step3["grad_norm"]],
                             [FIXTURE_STEP3["loss"], FIXTURE_STEP3["grad_norm"]], rtol=1e-5)
