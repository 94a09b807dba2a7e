"""Export: a sharded checkpoint becomes a Hugging Face Llama (Mistral, Qwen2) directory that
transformers and jaxzero load to the same logits; bad input is one clear line."""

import dataclasses
import hashlib
import json
import pathlib
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx, traverse_util
from safetensors import safe_open
from safetensors.numpy import load_file

from jaxzero import config
from jaxzero import engine as engine_lib
from jaxzero import export
from jaxzero.checkpoint import checkpointer as checkpoint_lib
from jaxzero.checkpoint import reader as reader_lib
from jaxzero.checkpoint.checkpointer import Checkpointer
from jaxzero.checkpoint.directory import checkpoint_dir
from jaxzero.checkpoint.reader import CheckpointReader
from jaxzero.hf import load as hf_load
from jaxzero.hf import metadata
from jaxzero.hf import tensors
from jaxzero.hf.export import export_hf
from jaxzero.models.llama import Llama, param_specs
from jaxzero.training import banner, loop

from damage import data_files, garbage_at_several_offsets
from hf_reference import hf_state_dict, params_from_hf, random_hf_model
from processes import TINY, child_env, run_python

# As in test_checkpoint, so that the training run reuses its compiled program.
SETTINGS = ["model.dim=64", "model.n_layers=2", "model.mlp_dim=128", "train.global_batch=16",
            "train.seq_len=32", "train.steps=10000", "train.log_every=1", "checkpoint.every=3",
            "data.max_bytes=200000"]




def hf_logits(directory, tokens) -> np.ndarray:
  """The logits of a Hugging Face export, loaded by transformers in float32."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  model = transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32)
  with torch.no_grad():
    return model(torch.tensor(tokens)).logits.numpy()

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """Two steps of stage 3 on 8 devices: every saved leaf is sharded."""
  workdir = tmp_path_factory.mktemp("run")
  env = child_env(tmp_path_factory.getbasetemp() / "jax_compilation_cache")
  settings = [arg for s in SETTINGS for arg in ("--set", s)]
  result = run_python("-m", "jaxzero.train", "--config", TINY, *settings, "--steps", "2",
                      "--workdir", str(workdir), "--no-progress", env=env, timeout=600)
  assert result.returncode == 0, result.stderr
  return config.load(TINY, SETTINGS), workdir


def master_weights(workdir) -> dict:
  """The fp32 master weights, read straight from the checkpoint."""
  with CheckpointReader(workdir) as reader:
    step = reader.resolve_step(None)
    shapes = {tuple(name.split("/")[1:]): shape
              for name, shape in reader.leaf_shapes(step).items() if name.startswith("master/")}
    flat = {path: reader.read(step, ("master", *path), shape) for path, shape in shapes.items()}
  return traverse_util.unflatten_dict(flat)


def jaxzero_logits(cfg, params, tokens):
  graphdef = nnx.split(nnx.eval_shape(lambda: Llama(cfg.model, rngs=nnx.Rngs(0))), nnx.Param)[0]
  model = nnx.merge(graphdef, jax.tree.map(jnp.asarray, params))
  return np.asarray(model(jnp.asarray(tokens)))


def snapshot(directory):
  root = pathlib.Path(directory)
  return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
          for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_export_loads_into_transformers_and_jaxzero_with_the_same_logits(trained, tmp_path,
                                                                        capsys):
  cfg, workdir = trained
  out = tmp_path / "hf"
  code = export.main(["--workdir", str(workdir), "--out", str(out),
                      "--max-shard-gb", str(60_000 / 2**30)])  # several files
  assert code == 0
  assert "exported step 2 (float32, " in capsys.readouterr().out

  index = json.loads((out / "model.safetensors.index.json").read_text())
  files = sorted(set(index["weight_map"].values()))
  assert len(files) >= 3
  assert files == [f"model-{i:05d}-of-{len(files):05d}.safetensors"
                   for i in range(1, len(files) + 1)]
  assert sorted(p.name for p in out.iterdir()) == sorted(
      ["config.json", "generation_config.json", "model.safetensors.index.json", *files])
  # A byte-level run ends a document with byte 0, and has no start or padding token.
  ids = {"bos_token_id": None, "eos_token_id": 0, "pad_token_id": None}
  for name in ("config.json", "generation_config.json"):
    assert ids.items() <= json.loads((out / name).read_text()).items()
  transformers = pytest.importorskip("transformers")
  generation = transformers.GenerationConfig.from_pretrained(out)
  assert (generation.bos_token_id, generation.eos_token_id) == (None, 0)
  assert sorted(index["weight_map"]) == sorted(tensors.hf_tensor_shapes(cfg.model))
  state_dict = {}
  for name in files:
    with safe_open(out / name, "np") as f:
      assert all(index["weight_map"][k] == name for k in f.keys())
    state_dict.update(load_file(out / name))
  assert index["metadata"]["total_size"] == sum(a.nbytes for a in state_dict.values())
  assert all(a.dtype == np.float32 for a in state_dict.values())

  # Exported weights are the checkpoint's master weights, bit for bit.
  master = master_weights(workdir)
  exported = params_from_hf(state_dict, cfg.model)
  jax.tree.map(np.testing.assert_array_equal, exported, master)

  tokens = np.random.default_rng(0).integers(0, 256, size=(2, 24))
  expected = jaxzero_logits(cfg, master, tokens)
  np.testing.assert_array_equal(jaxzero_logits(cfg, exported, tokens), expected)
  np.testing.assert_allclose(hf_logits(out, tokens), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.slow  # the trained fixture runs jaxzero.train
def test_bfloat16_export_is_the_rounded_master_weights(trained, tmp_path):
  cfg, workdir = trained
  done = export_hf(workdir, tmp_path / "hf", dtype="bfloat16")
  assert done.files == ["model-00001-of-00001.safetensors"]
  assert json.loads((done.out / "config.json").read_text())["dtype"] == "bfloat16"
  with safe_open(done.out / done.files[0], "np") as f:
    assert f.metadata() == {"format": "pt"}
  raw = (done.out / done.files[0]).read_bytes()
  header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
  assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}
  master = master_weights(workdir)
  expected = hf_state_dict(
      jax.tree.map(lambda w: w.astype(jnp.bfloat16), master), cfg.model)
  for name, value in expected.items():
    begin, end = header[name]["data_offsets"]
    data_start = 8 + int.from_bytes(raw[:8], "little")
    got = np.frombuffer(raw[data_start + begin:data_start + end], jnp.bfloat16)
    np.testing.assert_array_equal(got.reshape(header[name]["shape"]), value)


def damage(workdir, how):
  state = checkpoint_dir(workdir) / "2" / "state"
  if how == "truncated":
    for data_file in state.rglob("*"):
      if data_file.is_file() and data_file.parent.name == "d":
        data_file.write_bytes(data_file.read_bytes()[:10])
  elif how == "no_metadata":
    (state / "_METADATA").unlink()


@pytest.mark.parametrize("case, message", [
    ("empty", r"no checkpoint in \S+/checkpoints: --workdir must be a jaxzero.train workdir"),
    ("foreign", r"no checkpoint in \S+/checkpoints: --workdir must be a jaxzero.train workdir"),
    ("missing_step", r"no checkpoint of step 7 in \S+; available steps: 2"),
    ("truncated", r"checkpoint \S+/checkpoints/2 is damaged: leaf \S+ cannot be read: "),
    ("no_metadata", r"checkpoint \S+/2 is damaged: its state metadata \(state/_METADATA\) "),
    ("out_not_empty", r"--out \S+ already exists and is not an empty directory"),
])
@pytest.mark.slow  # the trained fixture runs jaxzero.train
def test_bad_input_is_one_line_and_nothing_is_overwritten(trained, tmp_path, capsys, case,
                                                           message):
  _, run_dir = trained
  workdir, out = tmp_path / "w", tmp_path / "out"
  args = []
  if case == "empty":
    workdir.mkdir()
  elif case == "foreign":
    (workdir / "checkpoints" / "latest").mkdir(parents=True)
    (workdir / "notes.txt").write_text("not a run")
  else:
    shutil.copytree(run_dir, workdir)
    damage(workdir, case)
  if case == "missing_step":
    args = ["--step", "7"]
  if case == "out_not_empty":
    out.mkdir()
    (out / "keep.txt").write_text("mine")
  before = snapshot(tmp_path)
  code = export.main(["--workdir", str(workdir), "--out", str(out), *args])
  stderr = capsys.readouterr().err
  assert code == 2, stderr
  errors = [line for line in stderr.splitlines() if "error" in line]
  assert len(errors) == 1 and re.search(message, errors[0]), stderr
  assert errors[0].startswith("jaxzero.export: error: ")
  assert "Traceback" not in stderr
  assert snapshot(tmp_path) == before
  assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
      ["w", "out"] if case == "out_not_empty" else ["w"])


def save_step_5(cfg, workdir) -> Llama:
  """Saves a fresh model of `cfg` as the checkpoint of step 5 in `workdir` (no training)."""
  model = Llama(cfg.model, rngs=nnx.Rngs(params=1))
  master = nnx.to_pure_dict(nnx.split(model, nnx.Param)[1])
  tx = engine_lib.make_optimizer(cfg)
  state = engine_lib.TrainState(jnp.int32(5), master, master, tx.init(master))
  info = checkpoint_lib.run_info(cfg.model, cfg.precision.compute, cfg.seed)
  with Checkpointer(workdir, cfg.checkpoint.keep, info) as checkpoints:
    checkpoints.save(5, state, wait=True)
  return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """A workdir with a checkpoint of step 5 and the config.json a run writes."""
  cfg, workdir = config.load(TINY, SETTINGS), tmp_path_factory.mktemp("saved")
  save_step_5(cfg, workdir)
  (workdir / "config.json").write_text(json.dumps({"data": dataclasses.asdict(cfg.data)}))
  return workdir


def export_error(argv, capsys) -> str:
  """The one error line of an export that must stop with exit code 2."""
  try:
    code = export.main(argv)
  except SystemExit as e:  # the parser's own checks
    code = e.code
  stderr = capsys.readouterr().err
  errors = [line for line in stderr.splitlines() if "error" in line]
  assert code == 2 and len(errors) == 1 and "Traceback" not in stderr, stderr
  assert errors[0].startswith("jaxzero.export: error: ")
  return errors[0]


@pytest.mark.parametrize("text, why", [
    ('{"data": ', r"not valid JSON at line 1 column 10"),
    ("{}", r"no data.tokenizer in it"),
])
def test_a_damaged_config_json_stops_the_export_before_anything_is_written(
    saved, tmp_path, capsys, text, why):
  shutil.copytree(saved, tmp_path / "w")
  (tmp_path / "w" / "config.json").write_text(text)
  before = snapshot(tmp_path)
  error = export_error(["--workdir", str(tmp_path / "w"), "--out", str(tmp_path / "out")],
                       capsys)
  assert re.search(rf"\S+/w/config.json is damaged \({why}\); export copies the tokenizer the "
                   "run records there: restore it, or move it aside", error), error
  assert snapshot(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["w"]


@pytest.mark.parametrize("leaf", ["master/embed_VxD", "master/layers/wo_LxHxExD"])
def test_an_export_checks_every_leaf_against_its_checksum(saved, tmp_path, capsys, leaf):
  """A leaf read whole or one layer at a time whose values are not the ones saved (here
  its recorded checksum is changed) stops the export with one line, writing nothing."""
  shutil.copytree(saved, tmp_path / "w")
  record = next((checkpoint_dir(tmp_path / "w") / "5" / "checksums").glob("metadata"))
  checksums = json.loads(record.read_text())
  checksums["checksums"][leaf] = f"{int(checksums['checksums'][leaf], 16) ^ 1:08x}"
  record.write_text(json.dumps(checksums))
  error = export_error(["--workdir", str(tmp_path / "w"), "--out", str(tmp_path / "out")],
                       capsys)
  assert re.search(rf"checkpoint \S+/w/checkpoints/5 is damaged: the values of leaf {leaf} do "
                   "not match the checksum saved with them$", error), error
  assert sorted(p.name for p in tmp_path.iterdir()) == ["w"]


@pytest.mark.parametrize("flag", [[], ["--peft"]])
def test_a_damaged_checksum_record_is_named_as_such(saved, tmp_path, capsys, flag):
  shutil.copytree(saved, tmp_path / "w")
  (checkpoint_dir(tmp_path / "w") / "5" / "checksums" / "metadata").write_text("{")
  if flag:  # a LoRA run's record, so that --peft reads on
    info_file = checkpoint_dir(tmp_path / "w") / "5" / "info" / "metadata"
    info_file.write_text(json.dumps({**json.loads(info_file.read_text()),
                                     "lora": {"rank": 4, "alpha": 8.0, "targets": ["q"]}}))
  error = export_error(["--workdir", str(tmp_path / "w"), "--out", str(tmp_path / "out"),
                        *flag], capsys)
  assert re.search(r"checkpoint \S+/checkpoints/5 is damaged: its checksums \(checksums/\) "
                   "cannot be read", error), error


def test_damaged_data_stops_an_export_with_one_line_or_exports_the_saved_weights(
    saved, tmp_path, capsys):
  """Garbage in the saved data (as a bad disk leaves it) is one line (here a read error
  that comes first; a checksum that differs is test_an_export_checks_every_leaf...), never
  a traceback or an export of other values (the damage may fall in the optimizer's state
  alone, which export does not read)."""
  good = export_hf(saved, tmp_path / "good")
  want = load_file(good.out / good.files[0])
  shutil.copytree(saved, tmp_path / "w")
  for damaged in data_files(checkpoint_dir(tmp_path / "w") / "5"):
    garbage_at_several_offsets(damaged)
    shutil.rmtree(tmp_path / "out", ignore_errors=True)
    code = export.main(["--workdir", str(tmp_path / "w"), "--out", str(tmp_path / "out")])
    stderr = capsys.readouterr().err
    if code == 0:
      got = load_file(tmp_path / "out" / good.files[0])
      assert got.keys() == want.keys()
      for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
      continue
    errors = [line for line in stderr.splitlines() if "error" in line]
    assert code == 2 and len(errors) == 1 and "Traceback" not in stderr, stderr
    assert re.search(r"checkpoint \S+/w/checkpoints/5 is damaged: ", errors[0]), errors
    assert not (tmp_path / "out").exists()
    return
  raise AssertionError("no damage to the data files stopped the export")


def test_weights_beyond_float16_are_refused_for_a_float16_export(tmp_path, capsys):
  cfg = config.load(TINY, SETTINGS)
  model = Llama(cfg.model, rngs=nnx.Rngs(params=1))
  master = nnx.to_pure_dict(nnx.split(model, nnx.Param)[1])
  master["final_norm"] = master["final_norm"] * 1e5
  state = engine_lib.TrainState(jnp.int32(5), master, master,
                                engine_lib.make_optimizer(cfg).init(master))
  with Checkpointer(tmp_path / "w", 1, checkpoint_lib.run_info(cfg.model, "float32", 0)) as c:
    c.save(5, state, wait=True)
  error = export_error(["--workdir", str(tmp_path / "w"), "--out", str(tmp_path / "out"),
                        "--dtype", "float16"], capsys)
  assert error.endswith("weight model.norm.weight has values beyond float16's range (largest "
                        "1e+05, float16's 65504): export it with --dtype bfloat16 or float32")
  assert sorted(p.name for p in tmp_path.iterdir()) == ["w"]


@pytest.mark.parametrize("model", [{"factory": "mymodel:build"}, {"parameters": 1000}],
                         ids=["model_factory", "engine"])
@pytest.mark.parametrize("flag", [[], ["--peft"], ["--merged"]])
def test_a_checkpoint_of_a_model_of_ones_own_is_refused_in_one_line(saved, tmp_path, capsys,
                                                                      model, flag):
  """A model_factory run or a jaxzero.Engine records its model as these do; export writes
  the built-in families only."""
  shutil.copytree(saved, tmp_path / "w")
  info_file = checkpoint_dir(tmp_path / "w") / "5" / "info" / "metadata"
  info = json.loads(info_file.read_text())
  info_file.write_text(json.dumps({**info, "model": model,
                                   **({"lora": {"rank": 4}} if flag else {})}))
  error = export_error(["--workdir", str(tmp_path / "w"), "--out", str(tmp_path / "out"),
                        *flag], capsys)
  assert re.search(r"checkpoint \S+/w/checkpoints/5 holds a model of your own \(model_factory "
                   r"or jaxzero.Engine\), not a built-in Llama, Mistral or Qwen2", error), error
  assert sorted(p.name for p in tmp_path.iterdir()) == ["w"]


def test_a_shard_size_that_is_not_a_positive_number_is_refused(saved, tmp_path, capsys):
  for size in ("nan", "inf", "0", "-1"):
    error = export_error(["--workdir", str(saved), "--out", str(tmp_path / "out"),
                          "--max-shard-gb", size], capsys)
    assert error.endswith(f"--max-shard-gb={float(size):g} must be a positive number"), error


@pytest.mark.parametrize("out, message", [
    ("w/checkpoints/9", r"--out \S+/w/checkpoints/9 is inside \S+/w/checkpoints, where the "
     r"next run would take the export for a damaged checkpoint and move it aside; write it "
     r"elsewhere, e.g. --out \S+/w/hf"),
    ("w/checkpoints", r"--out \S+/w/checkpoints is inside"),
    ("", r"--out is empty; name a directory"),
])
def test_an_export_among_the_checkpoints_or_nowhere_is_refused(saved, tmp_path, capsys, out,
                                                                message):
  shutil.copytree(saved, tmp_path / "w")
  before = snapshot(tmp_path)
  error = export_error(["--workdir", str(tmp_path / "w"),
                        "--out", str(tmp_path / out) if out else ""], capsys)
  assert re.search(message, error), error
  assert snapshot(tmp_path) == before
  assert export_error(["--workdir", "", "--out", str(tmp_path / "hf")], capsys).endswith(
      "--workdir is empty; name a directory")


def test_tied_embeddings_export_without_an_lm_head(tmp_path):
  """A checkpoint of a tied model (saved directly, no training) exports without
  lm_head.weight, and transformers ties it back to the same logits."""
  cfg = config.load(TINY, [*SETTINGS, "model.tie_embeddings=true"])
  model = save_step_5(cfg, tmp_path / "w")

  done = export_hf(tmp_path / "w", tmp_path / "hf")
  index = json.loads((done.out / "model.safetensors.index.json").read_text())
  assert "lm_head.weight" not in index["weight_map"]
  assert json.loads((done.out / "config.json").read_text())["tie_word_embeddings"] is True
  tokens = np.random.default_rng(1).integers(0, 256, size=(1, 12))
  expected = np.asarray(model(jnp.asarray(tokens)))
  np.testing.assert_allclose(hf_logits(done.out, tokens), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.slow  # the trained fixture runs jaxzero.train
def test_an_export_starts_a_new_run_with_the_same_weights(trained, tmp_path):
  cfg, workdir = trained
  done = export_hf(workdir, tmp_path / "hf")
  from_hf = config.load(TINY, [*SETTINGS, f"init.hf_checkpoint={done.out}"])
  outcome = loop.run_training(from_hf, tmp_path / "new", steps=0, progress=False)
  assert (outcome.start_step, outcome.step) == (0, 0)
  jax.tree.map(np.testing.assert_array_equal, master_weights(tmp_path / "new"),
               master_weights(workdir))
  # Once the run has a checkpoint, that is what it continues from.
  elsewhere = config.load(TINY, [*SETTINGS, "init.hf_checkpoint=/no/such/model"])
  outcome = loop.run_training(elsewhere, tmp_path / "new", steps=0, progress=False)
  assert outcome.start_step == 0


@pytest.mark.slow  # the trained fixture runs jaxzero.train
def test_export_reads_stacked_weights_one_layer_at_a_time(trained, tmp_path, monkeypatch):
  cfg, workdir = trained
  whole_reads, layer_reads = [], []
  read, layer_reader = CheckpointReader.read, reader_lib._LayerReader.__getitem__
  monkeypatch.setattr(CheckpointReader, "read",
                      lambda self, step, path, shape: whole_reads.append(path)
                      or read(self, step, path, shape))
  monkeypatch.setattr(reader_lib._LayerReader, "__getitem__",
                      lambda self, i: layer_reads.append(i) or layer_reader(self, i))
  done = export_hf(workdir, tmp_path / "hf", dtype="float32")
  # Only the unstacked leaves (embedding, final norm, head) are read whole.
  assert all(path[1] != "layers" for path in whole_reads), whole_reads
  n_stacked = len(param_specs(cfg.model)["layers"])
  assert len(layer_reads) == n_stacked * cfg.model.n_layers
  # And the layer-by-layer values are the checkpoint's, bit for bit.
  exported = {}
  for file in done.files:
    exported.update(load_file(done.out / file))
  expected = hf_state_dict(master_weights(workdir), cfg.model)
  for name, value in expected.items():
    np.testing.assert_array_equal(exported[name], value)


@pytest.mark.parametrize("family, tied, window, architecture", [
    ("mistral", False, 8, "MistralForCausalLM"),
    ("qwen2", True, 0, "Qwen2ForCausalLM"),
    ("qwen2", False, 6, "Qwen2ForCausalLM"),
])
def test_family_round_trip_through_a_checkpoint(family, tied, window, architecture, tmp_path):
  """A Hugging Face Mistral or Qwen2 directory, imported and saved as a jaxzero checkpoint,
  exports to a directory that transformers loads as the same class, to the same logits."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  original = random_hf_model(family, 2, tied, False, window)
  original.save_pretrained(tmp_path / "in")
  model = hf_load.load_llama(tmp_path / "in")
  master = nnx.to_pure_dict(nnx.split(model, nnx.Param)[1])
  cfg = config.Config(model=model.cfg, precision=config.PrecisionConfig(compute="float32"))
  state = engine_lib.TrainState(jnp.int32(0), master, master,
                                engine_lib.make_optimizer(cfg).init(master))
  info = checkpoint_lib.run_info(cfg.model, "float32", cfg.seed)
  with Checkpointer(tmp_path / "w", 1, info) as checkpoints:
    checkpoints.save(0, state, wait=True)

  done = export_hf(tmp_path / "w", tmp_path / "out")
  hf_config = json.loads((done.out / "config.json").read_text())
  assert (hf_config["architectures"], hf_config["model_type"]) == ([architecture], family)
  exported = transformers.AutoModelForCausalLM.from_pretrained(
      done.out, dtype=torch.float32, attn_implementation="eager")  # as `original`
  assert type(exported) is type(original)
  assert hf_load.read_config(done.out) == dataclasses.replace(model.cfg, attention="auto")
  tokens = torch.from_numpy(np.random.default_rng(1).integers(0, 97, size=(2, 24)))
  with torch.no_grad():
    want, got = original(tokens).logits.numpy(), exported(tokens).logits.numpy()
  np.testing.assert_array_equal(got, want)  # the same weights, bit for bit
  assert np.abs(np.asarray(model(jnp.asarray(tokens.numpy()))) - want).max() <= 1e-4


TEMPLATE = ("{% for m in messages %}{{ '<|' + m['role'] + '|> ' + m['content'] + ' <|end|> ' }}"
            "{% endfor %}")


def hf_base(directory, generation_config: bool = True):
  """A Hugging Face model directory as transformers writes it, weights left out (export
  reads none): config.json with the special tokens' ids and a context of 32768,
  generation_config.json (where asked), and a tokenizer whose chat template
  transformers 5 keeps in chat_template.jinja."""
  tokenizers = pytest.importorskip("tokenizers")
  transformers = pytest.importorskip("transformers")
  vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<|end|>": 3, "<pad>": 4, "hello": 5, "world": 6}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tokenizer = transformers.PreTrainedTokenizerFast(
      tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
      unk_token="<unk>", additional_special_tokens=["<|end|>"])
  tokenizer.chat_template = TEMPLATE
  tokenizer.save_pretrained(directory)
  assert (directory / "chat_template.jinja").is_file()
  transformers.LlamaConfig(
      vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
      num_key_value_heads=2, intermediate_size=128, max_position_embeddings=32768,
      rope_theta=10_000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
      pad_token_id=4).save_pretrained(directory)
  if generation_config:
    transformers.GenerationConfig(bos_token_id=1, eos_token_id=[2, 3], pad_token_id=4,
                                  do_sample=True, temperature=0.6).save_pretrained(directory)
  return directory


def export_run(tmp_path, base, init: bool = True, out=None, **data) -> pathlib.Path:
  """Exports a checkpoint of base's model, saved directly, from a workdir whose
  config.json records `base` as init.hf_checkpoint (where `init`) and as data.tokenizer,
  to `out` (default tmp_path / "hf")."""
  out = out or tmp_path / "hf"
  cfg = config.Config(model=hf_load.read_config(base),
                      precision=config.PrecisionConfig(compute="float32"))
  save_step_5(cfg, tmp_path / "w")
  run = {"init": {"hf_checkpoint": str(base) if init else ""},
         "data": dataclasses.asdict(dataclasses.replace(cfg.data, tokenizer=str(base), **data))}
  (tmp_path / "w" / "config.json").write_text(json.dumps(run))
  assert export.main(["--workdir", str(tmp_path / "w"), "--out", str(out)]) == 0
  return out


def test_a_run_records_its_tokenizer_and_base_so_that_export_finds_them_from_anywhere(
    tmp_path, monkeypatch):
  """A run started with relative paths records them absolute in WORKDIR/config.json and in
  a LoRA run's checkpoints: an export run from elsewhere copies that tokenizer, not
  whatever the same relative path names there (or nothing)."""
  hf_base(tmp_path / "train_here" / "base")
  cfg = config.base()
  cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer="base"),
                            init=dataclasses.replace(cfg.init, hf_checkpoint="base"))
  monkeypatch.chdir(tmp_path / "train_here")
  banner.write_config(cfg, tmp_path / "w")
  # A LoRA run's checkpoints name the base too (--merged and --peft read it from there).
  lora = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, rank=4))
  assert loop._lora_record(lora)["base_model"] == str(tmp_path / "train_here" / "base")
  (tmp_path / "elsewhere" / "base").mkdir(parents=True)
  monkeypatch.chdir(tmp_path / "elsewhere")
  run = metadata.read_run(tmp_path / "w")
  assert run["data"]["tokenizer"] == run["init"]["hf_checkpoint"] == str(
      tmp_path / "train_here" / "base")
  (tmp_path / "out").mkdir()
  assert "tokenizer.json" in metadata.copy_tokenizer(run, tmp_path / "out")
  assert metadata.generation_settings(run).config["max_position_embeddings"] == 32768


def test_an_empty_out_that_is_a_link_or_a_mount_point_is_written_into(tmp_path):
  """An existing empty --out is filled in place, not removed and replaced: a link stays a
  link, and a mount point (a container's volume) could be neither removed nor replaced."""
  (tmp_path / "volume").mkdir()
  (tmp_path / "link").symlink_to(tmp_path / "volume")
  out = export_run(tmp_path, hf_base(tmp_path / "base"), out=tmp_path / "link")
  assert out.is_symlink() and (tmp_path / "volume" / "config.json").is_file()
  assert not [p for p in (tmp_path / "volume").iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("generation_config", [True, False])
def test_an_export_carries_the_base_models_token_ids_context_and_generation_config(
    tmp_path, generation_config):
  """transformers' generate() stops at the base's end tokens, and sizes its caches by the
  base's max_position_embeddings (not the 8192 its default RoPE was made for)."""
  transformers = pytest.importorskip("transformers")
  base = hf_base(tmp_path / "base", generation_config)
  out = export_run(tmp_path, base)
  exported = json.loads((out / "config.json").read_text())
  assert {k: exported[k] for k in ("max_position_embeddings", "bos_token_id", "eos_token_id",
                                   "pad_token_id")} == {
      "max_position_embeddings": 32768, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 4}
  if generation_config:
    assert (out / "generation_config.json").read_text() == (
        base / "generation_config.json").read_text()
  model = transformers.AutoModelForCausalLM.from_pretrained(out)
  generation = model.generation_config
  assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == (
      1, [2, 3] if generation_config else 2, 4)
  assert model.config.max_position_embeddings == 32768


def test_the_runs_own_end_token_joins_the_base_models(tmp_path):
  """A fine-tune whose documents ended with data.eos_token (Llama-3.1's <|eot_id|> on its
  base) stops generating there too: it was left out of the base's end tokens."""
  base = hf_base(tmp_path / "base", generation_config=False)
  out = export_run(tmp_path, base, eos_token="<|end|>")
  assert json.loads((out / "config.json").read_text())["eos_token_id"] == [2, 3]
  assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [2, 3]


@pytest.mark.parametrize("own_template", [False, True])
def test_an_export_carries_the_chat_template_the_run_trained_with(tmp_path, own_template):
  """The tokenizer's chat_template.jinja, or the run's own data.chat_template."""
  transformers = pytest.importorskip("transformers")
  base = hf_base(tmp_path / "base")
  mine = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
  (tmp_path / "mine.jinja").write_text(mine)
  out = export_run(tmp_path, base, format="chat",
                   chat_template=str(tmp_path / "mine.jinja") if own_template else "")
  tokenizer = transformers.AutoTokenizer.from_pretrained(out)
  assert tokenizer.chat_template == (mine if own_template else TEMPLATE)
  assert tokenizer("hello world")["input_ids"] == [5, 6]


@pytest.mark.parametrize("init", [True, False])
def test_a_chat_fine_tune_stops_at_the_end_of_its_turn(tmp_path, init):
  """The special token the template ends an assistant's turn with (<|end|>) is an end token
  of the export, as the run learned to emit it; a plain-text run's are the base's."""
  base = hf_base(tmp_path / "base", generation_config=False)
  out = export_run(tmp_path, base, init=init, format="chat")
  for name in ("config.json", "generation_config.json"):
    assert json.loads((out / name).read_text())["eos_token_id"] == [2, 3]
  out = export_run(tmp_path, base, init=init, out=tmp_path / "text")
  assert json.loads((out / "config.json").read_text())["eos_token_id"] == 2


@pytest.mark.parametrize("eos_token, eos_ids", [("", 2), ("<|end|>", [2, 3])])
def test_a_run_from_scratch_takes_the_token_ids_from_its_tokenizer(tmp_path, eos_token,
                                                                   eos_ids):
  """No base model: the ids of the tokens the tokenizer names, the run's document
  separator (data.eos_token) an end token too; max_position_embeddings from RoPE."""
  base = hf_base(tmp_path / "base", generation_config=False)
  out = export_run(tmp_path, base, init=False, eos_token=eos_token)
  exported = json.loads((out / "config.json").read_text())
  ids = {"bos_token_id": 1, "eos_token_id": eos_ids, "pad_token_id": 4}
  assert {k: exported[k] for k in ids} == ids
  assert json.loads((out / "generation_config.json").read_text()) == ids
  assert exported["max_position_embeddings"] == 8192  # rope_original_max_len
