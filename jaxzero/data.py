"""Token data: the embedded corpus, and deterministic batches addressed by step.

The embedded corpus is the Python standard library's own source files, read as
bytes (vocabulary 256), so every machine with Python has it. Batches are
random windows drawn from the token stream with a generator seeded by
``(seed, step)``: the batch of step ``s`` is the same whatever the mesh, the
process count or whether the run was resumed, so the data position is just the
step number.
"""

from __future__ import annotations

import pathlib
import sysconfig

import numpy as np

BYTE_VOCAB = 256


class DataError(ValueError):
  """Bad data input, with a message naming the file or setting."""


def stdlib_corpus(max_bytes: int) -> np.ndarray:
  """Bytes of the standard library's .py files, in a fixed (sorted) order."""
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
  if not files:
    raise DataError(f"no .py files found under the standard library at {root}")
  chunks, total = [], 0
  for path in files:
    blob = path.read_bytes()
    chunks.append(blob)
    total += len(blob)
    if total >= max_bytes:
      break
  return np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8)


def load_tokens(source: str, max_bytes: int) -> np.ndarray:
  """The token stream for `data.source`: "stdlib" or a path to a text file."""
  if source == "stdlib":
    return stdlib_corpus(max_bytes)
  path = pathlib.Path(source)
  if not path.is_file():
    raise DataError(f"data.source={source!r} is neither 'stdlib' nor an existing text file")
  tokens = np.frombuffer(path.read_bytes()[:max_bytes], dtype=np.uint8)
  if tokens.size == 0:
    raise DataError(f"data file {source!r} is empty")
  return tokens


class Batches:
  """Batches of shape [grad_accum, global_micro_batch, seq_len + 1], by step."""

  def __init__(self, tokens: np.ndarray, seq_len: int, grad_accum: int, micro_batch: int,
               seed: int):
    if tokens.size < seq_len + 2:
      raise DataError(f"corpus has {tokens.size} tokens, fewer than train.seq_len+2="
                      f"{seq_len + 2}")
    self.tokens = tokens
    self.shape = (grad_accum, micro_batch, seq_len + 1)
    self.seed = seed

  def __call__(self, step: int, rows: slice = slice(None)) -> np.ndarray:
    """Batch for `step`; `rows` selects this process's share of the micro-batch."""
    rng = np.random.default_rng([self.seed, step])
    accum, batch, window = self.shape
    starts = rng.integers(0, self.tokens.size - window, size=(accum, batch))[:, rows]
    return self.tokens[starts[..., None] + np.arange(window)].astype(np.int32)
