"""`jaxzero.train --config` on a config that names the user's own model
(`model_factory`): it trains on the run's token batches, checkpoints and resumes,
with the banner, metrics and memory check of any run."""

import dataclasses
import json

import jax
import pytest

from jaxzero import config
from jaxzero.api import adapters
from processes import child_env, run_python

MODEL = '''
import jax.numpy as jnp
import optax
from flax import nnx


class TinyLM(nnx.Module):
  def __init__(self, rngs, vocab=256, dim=32, seq=16):
    self.embed = nnx.Embed(vocab, dim, rngs=rngs)
    self.pos = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (seq, dim)))
    self.mlp = nnx.Linear(dim, dim, rngs=rngs)
    self.norm = nnx.LayerNorm(dim, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens) + self.pos[...][:tokens.shape[1]]
    x = x + jnp.tanh(self.mlp(x))
    return self.embed.attend(self.norm(x))


def loss(model, tokens):
  logits = model(tokens[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def make():
  return {"model": lambda rngs: TinyLM(rngs), "loss_fn": loss, "min_shard_size": 0}
'''

CONFIG = '''
import dataclasses
from jaxzero import config


def get_config():
  c = config.base()
  return dataclasses.replace(
      c, model_factory="tiny_lm:make", mesh=config.MeshConfig(replica=1, fsdp=8),
      train=dataclasses.replace(c.train, steps=5, global_batch=16, grad_accum=2, seq_len=16,
                                lr=3e-3, warmup_steps=1),
      precision=config.PrecisionConfig(compute="float32"),
      checkpoint=config.CheckpointConfig(every=3), data=config.DataConfig(max_bytes=200_000))
'''


def train(tmp_path, workdir, *args):
  result = run_python("-m", "jaxzero.train", "--config", str(tmp_path / "my_config.py"),
                      "--workdir", str(workdir), "--no-progress", *args,
                      env=child_env(tmp_path / "xla_cache"))
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
  got, whole = losses(tmp_path / "w"), losses(tmp_path / "whole")
  assert len(got) == 5 and got[-1] < got[0]
  assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(got, whole)), (got, whole)
