"""`jaxzero.train --config` on a config that names the user's own model
(`model_factory`): it trains on the run's token batches, checkpoints and resumes,
with the banner, metrics and memory check of any run."""

import dataclasses
import json
import re

import jax
import pytest

from jaxzero import config
from jaxzero.api import adapters
from jaxzero.training import loop
from processes import ROOT, child_env, run_python

def _example(name: str) -> str:
  """A file of docs/any-model.md's complete model_factory example, as written there."""
  doc = (ROOT / "docs" / "any-model.md").read_text()
  (code,) = re.findall(rf"<!-- example: {re.escape(name)} -->\n```python\n(.*?)```", doc, re.S)
  return code


MODEL, CONFIG = _example("tiny_lm.py"), _example("my_config.py")


def train(tmp_path, workdir, *args, devices=8):
  result = run_python("-m", "jaxzero.train", "--config", str(tmp_path / "my_config.py"),
                      "--workdir", str(workdir), "--no-progress", *args,
                      env=child_env(tmp_path / "xla_cache", JAX_NUM_CPU_DEVICES=str(devices)))
  assert result.returncode == 0, result.stderr[-3000:]
  return result.stdout


def losses(workdir):
  return [json.loads(line)["loss"] for line in (workdir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("threshold, factory_says, whole", [
    (100_000, None, True),   # the default: every leaf of the tiny model is below it
    (0, None, False),        # zero.min_shard_size (ds stage3_param_persistence_threshold)
    (0, 100_000, True),      # the factory's own min_shard_size wins
])
def test_the_persistence_threshold_decides_which_leaves_stay_whole(
    tmp_path, monkeypatch, threshold, factory_says, whole):
  extra = "" if factory_says is None else f', "min_shard_size": {factory_says}'
  name = f"tiny_lm_{threshold}_{factory_says}"  # a module of its own: imports are cached
  (tmp_path / f"{name}.py").write_text(MODEL.replace(', "min_shard_size": 0}', extra + "}"))
  monkeypatch.syspath_prepend(str(tmp_path))
  cfg = dataclasses.replace(config.base(), model_factory=f"{name}:make",
                            zero=config.ZeroConfig(min_shard_size=threshold))
  specs = adapters.model_for(cfg, shard_size=8).specs
  axes = {jax.tree_util.keystr(path): leaf.logical_axes for path, leaf in
          jax.tree_util.tree_leaves_with_path(specs, is_leaf=lambda x: hasattr(x, "logical_axes"))}
  split = {path for path, names in axes.items() if set(names) != {"none"}}
  assert split == (set() if whole else set(axes)), axes  # tiny leaves: all whole, or all split


@pytest.mark.slow  # three runs of jaxzero.train
def test_a_user_model_trains_checkpoints_and_resumes(tmp_path):
  (tmp_path / "tiny_lm.py").write_text(MODEL)  # beside the config: found by its name
  (tmp_path / "my_config.py").write_text(CONFIG)
  out = train(tmp_path, tmp_path / "w", "--steps", "3")
  assert out.startswith("jaxzero.train: tiny_lm:make, ")
  # A user's model has no activation estimate: the banner and the first step say so, and
  # the first step's ratio is of the model state, the part that was predicted.
  assert "+ activations not estimated = " in out and "~0.0 MB" not in out
  assert "(activations not estimated); measured" in out and "the state " in out
  assert (tmp_path / "w" / "checkpoints" / "3").is_dir()
  resumed = train(tmp_path, tmp_path / "w")
  assert "trained to step 5" in resumed and (tmp_path / "w" / "checkpoints" / "5").is_dir()
  train(tmp_path, tmp_path / "whole")
  train(tmp_path, tmp_path / "one", devices=1)
  got, whole, one = (losses(tmp_path / w) for w in ("w", "whole", "one"))
  assert len(got) == 5 and got[-1] < got[0]
  assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(got, whole)), (got, whole)
  # Its dimension 31 divides no 8 devices: the leaves are padded, and train as on one.
  assert "kept whole" not in out
  assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(got, one)), (got, one)


@pytest.mark.slow  # four runs in this process
def test_the_examples_padded_leaves_train_at_stages_1_to_3_and_hybrid_as_on_one_device(
    tmp_path, monkeypatch):
  """Through jaxzero.train's loop: the example's dimension 31 divides no mesh here, so its
  square leaves are padded at every stage and under HYBRID, and each run's losses are one
  device's."""
  (tmp_path / "tiny_lm_padded.py").write_text(MODEL)
  monkeypatch.syspath_prepend(str(tmp_path))
  namespace = {}
  exec(CONFIG.replace("tiny_lm:make", "tiny_lm_padded:make"), namespace)  # pylint: disable=exec-used
  base = namespace["get_config"]()
  base = dataclasses.replace(base, train=dataclasses.replace(base.train, steps=3),
                             checkpoint=config.CheckpointConfig(every=0))

  def run(name, devices, **zero):
    cfg = dataclasses.replace(base, zero=dataclasses.replace(base.zero, **zero),
                              mesh=config.MeshConfig(replica=2 if zero.get("hybrid") else 1,
                                                     fsdp=-1))
    loop.run_training(cfg, tmp_path / name, devices=jax.devices()[:devices], progress=False)
    return losses(tmp_path / name)

  one = run("one", 1, stage=0)
  for stage, hybrid in ((1, False), (2, False), (3, True)):
    got = run(f"stage{stage}{hybrid}", 8, stage=stage, hybrid=hybrid)
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(got, one)), (stage, got, one)


@pytest.mark.slow  # two short runs in this process
def test_a_factory_models_lora_is_recorded_and_another_alpha_is_refused(tmp_path, monkeypatch):
  """A model_factory that returns jaxzero.lora(...) records its rank, alpha and targets
  with each checkpoint, as jaxzero.Engine does: a resume under another alpha is refused."""
  from jaxzero.checkpoint.reader import CheckpointReader  # pylint: disable=import-outside-toplevel
  from jaxzero.errors import CheckpointError  # pylint: disable=import-outside-toplevel
  (tmp_path / "tiny_lm.py").write_text(MODEL)
  for alpha in (8, 64):
    (tmp_path / f"lora_lm_{alpha}.py").write_text(
        "import jaxzero\nimport tiny_lm\n\n\ndef make():\n  spec = tiny_lm.make()\n"
        f"  return {{**spec, 'model': jaxzero.lora(spec['model'], rank=2, alpha={alpha}, "
        "targets='mlp/kernel')}\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  base = config.base()
  cfg = lambda alpha: dataclasses.replace(
      base, model_factory=f"lora_lm_{alpha}:make", model=dataclasses.replace(base.model,
                                                                             vocab_size=256),
      mesh=config.MeshConfig(replica=1, fsdp=2),
      train=dataclasses.replace(base.train, steps=1, global_batch=4, grad_accum=1, seq_len=16),
      precision=config.PrecisionConfig(compute="float32"),
      data=config.DataConfig(max_bytes=100_000))
  loop.train(cfg(8), tmp_path / "w", devices=jax.devices()[:2], progress=False)
  with CheckpointReader(tmp_path / "w") as reader:
    assert reader.info(1)["lora"] == {"rank": 2, "alpha": 8.0, "targets": "mlp/kernel"}
  with pytest.raises(CheckpointError, match=re.escape(
      "was trained with jaxzero.lora(alpha=8), this model has alpha=64: the adapters would be "
      "scaled otherwise; make it with jaxzero.lora(..., alpha=8)")):
    loop.train(cfg(64), tmp_path / "w", 2, devices=jax.devices()[:2], progress=False)
  # Another rank: the settings to make it again, as jaxzero.lora's arguments.
  (tmp_path / "lora_lm_r4.py").write_text((tmp_path / "lora_lm_8.py").read_text().replace(
      "rank=2", "rank=4"))
  other = dataclasses.replace(cfg(8), model_factory="lora_lm_r4:make")
  with pytest.raises(CheckpointError, match=re.escape(
      "(lora.rank=2 in the checkpoint, 4 here); make the model with jaxzero.lora(rank=2, "
      "alpha=8, targets='mlp/kernel') to resume it")):
    loop.train(other, tmp_path / "w", 2, devices=jax.devices()[:2], progress=False)
