"""The shape of the code, and the promises that survive changes to it.

* Layers: a module imports only from its own layer and the layers below it
  (LAYERS, bottom first); every subpackage has a place in that order.
* Public APIs only: no ``jax._src`` or ``orbax.checkpoint._src`` anywhere.
* One job per module: none grows past ~450 lines; no function of the engine past 60.
* One function chooses the runner (jaxzero.runners.choose); the training loop and
  jaxzero.Engine call it and never branch on offload themselves.
* One top-level package, and ``import jaxzero`` starts no JAX.
* A checkpoint written by an earlier jaxzero (tests/fixtures/checkpoint_v0_1,
  saved by the first release's ``jaxzero.train``) still resumes, and the next
  step gives the loss the earlier release computed.
"""

import ast
import pathlib
import re
import shutil

import jax
import numpy as np

from jaxzero import config
from jaxzero.training import loop

from processes import ROOT, run_python

PACKAGE = ROOT / "jaxzero"
SOURCES = sorted(p for folder in ("jaxzero", "scripts", "tests", "configs")
                 for p in (ROOT / folder).rglob("*.py"))
MAX_MODULE_LINES = 450  # "about 450": room for a docstring, not for a second job
MAX_ENGINE_FUNCTION_LINES = 60  # the step is composed of short parts, not branched

# Bottom first. A module may import from its own layer and any layer below it.
# A subpackage is named by its folder; a top-level module by its file name.
LAYERS = (
    ("utils", "errors", "models"),  # no jaxzero imports but these
    ("config",),
    ("parallel",),  # the mesh, the ZeRO layouts, the pipeline schedules, the model cut
    ("runtime",),  # jax.distributed, the peer watch, XLA flags
    ("data",),
    ("engine",),  # the train state, the optimizer, the composed jitted step
    ("checkpoint",),
    ("offload",),  # the NVMe store, its checkpoint side item, the per-layer programs
    ("runners",),  # one protocol: in memory, NVMe, ZeRO-Infinity; chosen in one place
    ("planning",),
    ("hf", "frameworks"),  # Hugging Face weights; DeepSpeed and Accelerate configs
    ("api",),  # jaxzero.Engine: any model, as a library
    ("training",),
    ("cli", "train", "plan", "launch", "export", "migrate", "__init__"),  # the commands
)
LAYER_OF = {unit: i for i, units in enumerate(LAYERS) for unit in units}

# The settings the fixture was trained with (configs/tiny_zero3.py, smaller), and
# what the first release logged for step 3 when it resumed from step 2.
FIXTURE = ROOT / "tests" / "fixtures" / "checkpoint_v0_1"
FIXTURE_SETTINGS = ["model.dim=32", "model.n_layers=2", "model.mlp_dim=64", "model.n_heads=4",
                    "model.n_kv_heads=2", "train.global_batch=8", "train.grad_accum=1",
                    "train.seq_len=16", "train.steps=2", "data.max_bytes=100000",
                    "checkpoint.every=2"]
FIXTURE_STEP3 = {"loss": 5.4413743019104, "grad_norm": 1.8503363132476807}


def unit_of(path: pathlib.Path) -> str:
  """The layer unit of a module of the package: its subpackage, or its file's stem."""
  parts = path.relative_to(PACKAGE).parts
  return parts[0] if len(parts) > 1 else path.stem


def imported_units(source: str) -> set[str]:
  """The units of jaxzero a module's source imports, at any depth of the file."""
  units = set()
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      names = ([f"{node.module}.{a.name}" for a in node.names] if node.module == "jaxzero"
               else [node.module])
    else:
      continue
    units |= {n.split(".")[1] for n in names if n.startswith("jaxzero.")}
  return units


def upward_imports(unit: str, source: str) -> list[str]:
  """The units `source` (a module of `unit`) imports from layers above its own."""
  return sorted(u for u in imported_units(source) if LAYER_OF[u] > LAYER_OF[unit])


def test_every_module_has_a_layer():
  units = {unit_of(p) for p in PACKAGE.rglob("*.py")}
  assert units <= set(LAYER_OF), f"place these in LAYERS: {sorted(units - set(LAYER_OF))}"
  folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
  assert folders <= set(LAYER_OF), sorted(folders - set(LAYER_OF))
  assert all((PACKAGE / f / "__init__.py").is_file() for f in folders)
  # The tests mirror the package: a folder of tests is named for the subpackage it tests.
  test_folders = {p.name for p in (ROOT / "tests").iterdir() if p.is_dir()}
  assert test_folders - {"fixtures", "__pycache__"} <= folders


def test_no_module_imports_from_a_layer_above_its_own():
  upward = {str(p.relative_to(ROOT)): bad for p in PACKAGE.rglob("*.py")
            if (bad := upward_imports(unit_of(p), p.read_text()))}
  assert not upward, upward


def test_the_layer_check_sees_an_upward_import():
  # What a regression would look like: the engine reaching into the training loop.
  assert upward_imports("engine", "def f():\n  from jaxzero.training import loop\n") == [
      "training"]
  assert upward_imports("parallel", "import jaxzero.planning.planner\n") == ["planning"]
  assert upward_imports("offload", "from jaxzero import train\n") == ["train"]
  assert upward_imports("training", "from jaxzero.runners import nvme\n") == []


def test_the_engine_and_sharding_layers_know_no_particular_model():
  # Any model enters through jaxzero.models.interface; the Llama is one client.
  offenders = {str(p.relative_to(ROOT)) for folder in ("engine", "parallel")
               for p in (PACKAGE / folder).rglob("*.py")
               if re.search(r"jaxzero\.models\.(llama|trainable|attention|loss)|"
                            r"from jaxzero\.models import (llama|trainable)", p.read_text())}
  assert not offenders, offenders


def test_one_place_chooses_the_runner():
  # jaxzero.runners.choose.make_runner reads the offload section; the loop and the
  # library's Engine call it, and neither names a runner or branches on offload.
  chooser = PACKAGE / "runners" / "choose.py"
  constructs = re.compile(r"\b(InMemoryRunner|HostRunner|NvmeRunner|InfinityRunner)\(")
  outside = {str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py")
             if p != chooser and p.parent.name != "runners" and constructs.search(p.read_text())}
  assert not outside, outside
  for client in (PACKAGE / "training" / "loop.py", PACKAGE / "api" / "engine.py"):
    source = client.read_text()
    assert "make_runner(" in source, client
    branches = (r"jaxzero\.offload|runners import (nvme|infinity)"
                r"|offload\.(optimizer|params) *(==|!=| in )")
    assert not re.search(branches, source), client


def test_no_function_in_the_engine_is_long():
  long = {}
  for path in (PACKAGE / "engine").rglob("*.py"):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        length = node.end_lineno - node.lineno + 1
        if length > MAX_ENGINE_FUNCTION_LINES:
          long[f"{path.relative_to(ROOT)}:{node.name}"] = length
  assert not long, long


def test_no_private_jax_or_orbax_api():
  private = re.compile(r"\b(jax|orbax\.checkpoint)\._src\b|from (jax|orbax\.checkpoint) import _src")
  offenders = [f"{p.relative_to(ROOT)}:{i}" for p in SOURCES
               for i, line in enumerate(p.read_text().splitlines(), 1)
               if private.search(line) and p.name != "test_architecture.py"]
  assert not offenders, offenders


def test_no_module_is_a_grab_bag():
  library = list(PACKAGE.rglob("*.py"))
  assert len(library) > 40  # every subpackage's modules are counted, not just the top level
  long = {str(p.relative_to(ROOT)): n for p in library
          if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
  assert not long, long


def test_one_top_level_package_and_its_import_starts_no_jax():
  pyproject = (ROOT / "pyproject.toml").read_text()
  assert re.search(r'^include = \["jaxzero\*"\]$', pyproject, re.M), "install jaxzero alone"
  assert not any(p.is_file() and p.name == "__init__.py"
                 for folder in ROOT.iterdir() if folder.is_dir() and folder.name != "jaxzero"
                 for p in folder.iterdir())
  code = "import sys, jaxzero; print('jax' in sys.modules)"
  started = run_python("-c", code)
  assert started.returncode == 0, started.stderr
  assert started.stdout.strip() == "False"


def test_a_checkpoint_from_the_first_release_still_resumes(tmp_path):
  shutil.copytree(FIXTURE, tmp_path / "checkpoints")
  cfg = config.load(str(ROOT / "configs" / "tiny_zero3.py"), FIXTURE_SETTINGS)
  outcome = loop.run_training(cfg, tmp_path, steps=3, devices=jax.devices()[:8], progress=False)
  assert outcome.start_step == 2
  (step3,) = outcome.history
  assert step3["step"] == 3
  np.testing.assert_allclose([step3["loss"], step3["grad_norm"]],
                             [FIXTURE_STEP3["loss"], FIXTURE_STEP3["grad_norm"]], rtol=1e-5)
