"""A run's data: its training batches and held-out batches, from either kind of source.

``data.format=text`` cuts a token stream (jaxzero.data.tokens) into windows
(jaxzero.data.batches.Batches); ``chat`` and ``prompt_completion`` put tokenized
examples (jaxzero.data.sft) into rows. The held-out split is ``data.eval_fraction``
of the stream or of the examples, cut from the end (training keeps the rest), or the
separate ``data.eval_source`` read the same way. Held-out batches are ``eval.batches``
fixed batches of ``train.global_batch / train.grad_accum`` rows from the split's start,
the same whatever the stage, mesh or process count. A data.eval_source names files
training does not read; that, and that it names any, is checked before tokenizing.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import re
from typing import NamedTuple

import numpy as np

from jaxzero.data import batches as batches_lib
from jaxzero.data import sft
from jaxzero.data import sources
from jaxzero.data import tokens as tokens_lib
from jaxzero.errors import DataError

log = logging.getLogger(__name__)


class RunData(NamedTuple):
  train: batches_lib.Batches | sft.ExampleBatches
  held_out: EvalBatches | sft.ExampleBatches | None
  description: str  # what the training batches hold, for the banner
  held_out_left_out: str = ""  # the held-out examples left out, by reason, for the banner


def open_data(cfg, workdir, rows: int, *, progress: bool = True) -> RunData:
  """The batches of `cfg` with `rows` rows per micro-batch (all data-parallel devices'),
  tokenizing its sources into the cache if needed."""
  d, t = cfg.data, cfg.train
  _warn_of_held_out_files(d)
  eval_rows = t.global_batch // t.grad_accum
  held_out_cfg = dataclasses.replace(d, source=d.eval_source)
  if d.eval_source:
    check_held_out_apart(d)  # before anything is tokenized
  if d.format == "text":
    source = tokens_lib.open_tokens(d, workdir, model_vocab_size=cfg.model.vocab_size,
                                    progress=progress)
    tokens, held_out = split(source.tokens, d)
    if d.eval_source:
      held_out = _naming_eval_source(d, lambda: tokens_lib.open_tokens(
          held_out_cfg, workdir, progress=progress, model_vocab_size=cfg.model.vocab_size)).tokens
    try:
      train = batches_lib.Batches(tokens, t.seq_len, t.grad_accum, rows, cfg.seed,
                                  order=source.order)
    except DataError as e:
      if not d.eval_fraction:
        raise
      raise DataError(f"the training split, after data.eval_fraction={d.eval_fraction} of "
                      f"{source.tokens.size:,} tokens is held out: {e}") from e
    evaluation = None if held_out is None else EvalBatches(
        held_out, cfg.eval.batches, eval_rows, t.seq_len, _held_out_name(d))
    return RunData(train, evaluation, f"{d.source}: {tokens.size:,} training tokens")
  examples = sft.open_examples(d, workdir, model_vocab_size=cfg.model.vocab_size,
                               progress=progress)
  examples, held_out = sft.split(examples, d.eval_fraction)
  if d.eval_source:
    held_out = _naming_eval_source(d, lambda: sft.open_examples(
        held_out_cfg, workdir, model_vocab_size=cfg.model.vocab_size, progress=progress))
  rows_of = lambda ex, accum, n, order: sft.ExampleBatches(
      ex, t.seq_len, accum, n, cfg.seed, packing=d.packing, overlong=d.overlong, order=order)
  train = rows_of(examples, t.grad_accum, rows, "epochs")
  evaluation = None
  if held_out is not None:
    try:
      evaluation = rows_of(held_out, cfg.eval.batches, eval_rows, "fixed")
    except DataError as e:  # the training examples fit: say which split this is
      raise DataError(f"the held-out examples ({_held_out_name(d)}): {e}") from e
  return RunData(train, evaluation, _describe_examples(d, examples, train),
                 "; ".join(_left_out(held_out, evaluation)) if evaluation else "")


# Names a dataset gives its held-out splits (Hugging Face's test-00000-of-00001.parquet,
# test_sft-*.parquet, validation/, dev.jsonl, ...).
_HELD_OUT_NAME = re.compile(r"(test|valid|validation|eval|dev)([_\-.]|$)", re.IGNORECASE)


def position_settings(cfg) -> dict:
  """The settings a step's rows are found from (step x global batch into the split's
  windows or packed rows): a checkpoint records them, and a run resumed under others
  reads other rows from there on."""
  return {"train.global_batch": cfg.train.global_batch, "train.seq_len": cfg.train.seq_len,
          "data.eval_fraction": cfg.data.eval_fraction, "data.packing": cfg.data.packing}


def _warn_of_held_out_files(d) -> None:
  """Warns where a directory source reads files a dataset names as a held-out split:
  they are trained on (and data.eval_fraction holds out other files' rows)."""
  # (As match_files names the files: under the path given, links in it unresolved.)
  root = pathlib.Path(os.path.abspath(os.path.expanduser(d.source)))
  if d.source == "stdlib" or not root.is_dir():
    return
  named = [p for p in sources.match_files(d.source)
           if any(_HELD_OUT_NAME.match(part) for part in p.relative_to(root).parts)]
  if named:
    log.warning("data.source=%s reads %d file(s) named as a held-out split (first %s): they "
                "are trained on; name the training files (a glob, such as %s/**/train*) and "
                "give the others as data.eval_source", d.source, len(named),
                named[0].relative_to(root), d.source.rstrip("/"))


def check_held_out_apart(d) -> None:
  """Refuses a data.eval_source that names no file, or a file training also reads (its
  evaluation would then be of trained-on text), however the paths reach it."""
  if d.eval_source == "stdlib":
    if d.source == "stdlib" or d.format != "text":
      raise DataError("data.eval_source='stdlib' holds the standard library's text: "
                      + ("data.source='stdlib' trains on it; hold out data.eval_fraction of it"
                         if d.source == "stdlib" else
                         f"data.format={d.format!r} reads records; name a file of them"))
    return
  held_out = {p.resolve() for p in sources.match_files(d.eval_source, "data.eval_source")}
  if d.source == "stdlib":
    return
  shared = sorted({p.resolve() for p in sources.match_files(d.source)} & held_out)
  if shared:
    raise DataError(f"data.eval_source={d.eval_source!r} names {len(shared)} file(s) that "
                    f"data.source={d.source!r} trains on too (first {shared[0]}); point them "
                    "at separate files, or hold out data.eval_fraction of data.source")


def _naming_eval_source(d, open_held_out):
  """open_held_out()'s split, read as data.source is: its errors name data.eval_source,
  the setting they are about."""
  try:
    return open_held_out()
  except DataError as e:
    raise DataError(str(e).replace(f"data.source={d.eval_source!r}",
                                   f"data.eval_source={d.eval_source!r}")
                    .replace("files of data.source", "files of data.eval_source")) from e


def _left_out(examples: sft.Examples, batches: sft.ExampleBatches) -> list[str]:
  """What of `examples` the rows leave out or cut, by reason."""
  left_out = [f"{v['count']} {reason} (first at {v['first']})"
              for reason, v in examples.skipped.items()]
  left_out += [f"{n} {reason}" for reason, n in batches.dropped.items()]
  if batches.truncated:
    left_out.append(f"{batches.truncated} truncated to train.seq_len+1")
  return left_out


def _describe_examples(d, examples: sft.Examples, train: sft.ExampleBatches) -> str:
  left_out, kept = _left_out(examples, train), len(train.lengths)
  packed = f"packed {kept / train.n_rows:.2g} per row" if d.packing else "one per row"
  return (f"{d.source} ({d.format}): {kept:,} examples, {train.n_tokens:,} tokens in "
          f"{train.n_rows:,} rows ({packed}, {train.fill:.0%} filled)"
          + (f"; left out: {'; '.join(left_out)}" if left_out else ""))


def _held_out_name(d) -> str:
  return (f"data.eval_fraction={d.eval_fraction}" if d.eval_fraction
          else f"data.eval_source={d.eval_source!r}")


def split(tokens: np.ndarray, data) -> tuple[np.ndarray, np.ndarray | None]:
  """(training tokens, held-out tokens) of a stream, by data.eval_fraction."""
  if not data.eval_fraction:
    return tokens, None
  held_out = int(tokens.size * data.eval_fraction)
  return tokens[:tokens.size - held_out], tokens[tokens.size - held_out:]


class EvalBatches:
  """``n_batches`` batches of ``rows`` windows of ``seq_len + 1`` tokens, [N, rows, T+1].

  Window i starts at token ``i * seq_len`` (consecutive windows share one token,
  so every token but the first is a target once); a split shorter than the
  batches need is visited again from its start.
  """

  def __init__(self, tokens: np.ndarray, n_batches: int, rows: int, seq_len: int, what: str):
    if tokens.size < seq_len + 2:
      raise DataError(f"{what} leaves {tokens.size} tokens for evaluation, fewer than "
                      f"train.seq_len+2={seq_len + 2}; hold out more")
    self.tokens = tokens
    self.shape = (n_batches, rows, seq_len + 1)
    self.n_windows = (tokens.size - 1) // seq_len

  @property
  def n_tokens(self) -> int:
    return self.tokens.size

  def __call__(self, _step: int = 0, rows: slice = slice(None)) -> np.ndarray:
    n, batch, window = self.shape
    starts = batches_lib.fixed_order(n, batch, rows, self.n_windows) * (window - 1)
    return np.asarray(self.tokens[starts[..., None] + np.arange(window)], np.int32)
