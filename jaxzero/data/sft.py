"""Fine-tuning examples: tokenized once with their loss masks, then cut into rows.

``data.format=chat|prompt_completion`` reads records (jaxzero.data.chat) from
``.jsonl`` or ``.parquet`` files, tokenizes each as one example and caches the
tokens, a target mask (1 on the assistant's or the completion's tokens) and the
examples' offsets in ``data.cache_dir``, reused like the text cache. Records that
cannot be used are counted by reason, with the first place each occurred.

Rows have ``seq_len + 1`` positions. Without ``data.packing`` a row is one
example, padded; with it, best-fit-decreasing fills each row with whole examples,
told apart by segment ids (1, 2, ...; padding is 0) so that attention, positions
and the loss stay within one example. An example longer than a row is truncated
to it or dropped (``data.overlong``); one left without a target is dropped. Rows
are visited in a seeded order that changes every epoch, addressed by step like
jaxzero.data.batches.Batches.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import pathlib
from typing import Iterator

import numpy as np

from jaxzero.data import batches as batches_lib
from jaxzero.data import cache as cache_lib
from jaxzero.data import chat, documents
from jaxzero.data import sources
from jaxzero.data import tokens as tokens_lib
from jaxzero.errors import DataError
from jaxzero.utils.files import write_json_atomic

MASK_FILE, STARTS_FILE = "mask.bin", "starts.bin"
SUFFIXES = (".jsonl", ".parquet")
# Bump when the rendering, the targets or the files change: caches are then rebuilt.
CACHE_FORMAT = 4


@dataclasses.dataclass(frozen=True)
class Examples:
  """Tokenized examples: example i is ``tokens[starts[i]:starts[i + 1]]``."""
  tokens: np.ndarray  # 1-D token ids, examples in file order
  mask: np.ndarray  # 1-D uint8 beside `tokens`: 1 where the token is a target
  starts: np.ndarray  # [n + 1] int64 offsets
  vocab_size: int
  skipped: dict  # reason -> {"count": n, "first": "FILE:LINE"}

  def __len__(self) -> int:
    return self.starts.size - 1

  def take(self, first: int, stop: int) -> "Examples":
    """Examples first..stop-1 (the offsets stay absolute)."""
    return dataclasses.replace(self, starts=self.starts[first:stop + 1])


def open_examples(data, workdir, *, model_vocab_size: int | None = None,
                  progress: bool = True) -> Examples:
  """The examples of `data` (a DataConfig with a fine-tuning format), tokenized once."""
  files = sources.match_files(data.source, exclude=sources.run_outputs(data, workdir))
  for path in files:
    if path.suffix.lower() not in SUFFIXES:
      raise DataError(f"data.format={data.format!r} reads records from {' or '.join(SUFFIXES)} "
                      f"files; data.source={data.source!r} includes {path}")
  tokenizer = tokens_lib.load_tokenizer(data.tokenizer, data.eos_token, data.format)
  tokens_lib.check_vocab(data.tokenizer, tokenizer.vocab_size, model_vocab_size)
  template = chat.load_template(data)
  if data.format == "chat" and template is None:
    raise DataError(f"data.format='chat' needs a chat template: data.tokenizer="
                    f"{data.tokenizer!r} has none beside it; set data.chat_template")
  digest = template.digest if template else ""
  cache = (cache_lib.cache_root(data, workdir) /
           cache_lib.cache_name(data, tokenizer, data.format, digest, f"sft{CACHE_FORMAT}"))
  want = dict(cache_lib.index_header(files, tokenizer, data.text_field),
              data_format=data.format, template_sha256=digest, sft_format=CACHE_FORMAT)
  index = cache_lib.cached(cache, want, _read_index,
                            lambda: _tokenize(files, tokenizer, template, data, cache, want,
                                              progress))
  n = index["tokens"]
  return Examples(np.memmap(cache / cache_lib.TOKENS_FILE, index["dtype"], "r", shape=(n,)),
                  np.memmap(cache / MASK_FILE, np.uint8, "r", shape=(n,)),
                  np.fromfile(cache / STARTS_FILE, np.int64), tokenizer.vocab_size,
                  index["skipped"])


def split(examples: Examples, fraction: float) -> tuple[Examples, Examples | None]:
  """(training examples, the last `fraction` of them held out) by data.eval_fraction."""
  if not fraction:
    return examples, None
  held_out = int(len(examples) * fraction)
  if not held_out:
    raise DataError(f"data.eval_fraction={fraction} of {len(examples)} examples holds none out")
  return examples.take(0, len(examples) - held_out), examples.take(len(examples) - held_out,
                                                                    len(examples))


def _read_index(cache: pathlib.Path) -> dict | None:
  index = cache_lib.read_index(cache)
  try:
    ok = index is not None and (cache / MASK_FILE).stat().st_size == index["tokens"] and (
        cache / STARTS_FILE).stat().st_size == 8 * (index["examples"] + 1)
  except (OSError, KeyError):
    ok = False
  return index if ok else None


def _records(path: pathlib.Path) -> Iterator[tuple[str, object]]:
  """(FILE:LINE, record, or the reason it is unreadable) of each row."""
  if path.suffix.lower() == ".jsonl":
    for line_no, text, _ in documents.jsonl_lines(path):
      if text.strip():
        try:
          yield f"{path.name}:{line_no}", json.loads(text)
        except (ValueError, RecursionError) as e:  # (a line nested past Python's limit)
          yield f"{path.name}:{line_no}", chat.Skip(f"not valid JSON ({e.__class__.__name__})")
    return
  row = 0
  for batch in documents.open_parquet(path).iter_batches(batch_size=documents.PARQUET_ROWS):
    for record in batch.to_pylist():
      row += 1
      yield f"{path.name}:row {row}", record


@dataclasses.dataclass
class _Writer:
  """Appends examples to the cache files, counting what is skipped."""
  tokenizer: tokens_lib.TextTokenizer
  tokens: object
  mask: object
  starts: list = dataclasses.field(default_factory=lambda: [0])
  skipped: dict = dataclasses.field(default_factory=dict)

  def skip(self, where: str, reason: str) -> None:
    kind = self.skipped.setdefault(reason, {"count": 0, "first": where})
    kind["count"] += 1

  def add(self, pending: list[tuple[str, str, list, bool]]) -> None:
    """Tokenizes (place, text, spans, plain) records and appends the usable ones, in
    their order."""
    encoded = [None] * len(pending)
    for plain in (True, False):
      chosen = [i for i, p in enumerate(pending) if p[3] == plain]
      for i, result in zip(chosen, self.tokenizer.encode_spans([pending[i][1] for i in chosen],
                                                               plain)):
        encoded[i] = result
    for (where, _text, spans, plain), (ids, offsets, added) in zip(pending, encoded):
      ids = np.asarray(ids, self.tokenizer.dtype)
      starts, ends = np.asarray(offsets).reshape(-1, 2).T
      # Where a token begins: a tokenizer that trims offsets (GPT-2's) starts " three" after
      # its space, but it began where the token before it ended.
      begins = np.minimum(starts, np.concatenate([[0], ends[:-1]]))
      target = np.zeros(ids.size, bool)
      for start, end in spans:
        # A chat's targets are every token with a character in a span, as transformers'
        # assistant_masks marks them; a plain completion's, the tokens that begin in it, as
        # TRL counts the prompt's tokens (a token across the boundary is the prompt's).
        target |= (begins >= start if plain else ends > start) & (starts < end)
      target &= ~np.asarray(added, bool)  # a start token the tokenizer adds is not a target
      if plain:  # the end-of-text token ends the completion, and is learned
        sep = np.asarray(self.tokenizer.separator, ids.dtype)
        if not np.array_equal(ids[-sep.size:], sep):
          ids, target = np.concatenate([ids, sep]), np.concatenate([target, np.ones(sep.size,
                                                                                    bool)])
        target[-sep.size:] = True
      if not target[1:].any():
        self.skip(where, "no target token after tokenization")
        continue
      self.tokens.write(ids.tobytes())
      self.mask.write(target.astype(np.uint8).tobytes())
      self.starts.append(self.starts[-1] + ids.size)


def _write_examples(files, tokenizer, template, data, partial: dict, progress: bool):
  """Tokenizes every record into the partial token and mask files; returns the writer."""
  from tqdm import tqdm  # pylint: disable=import-outside-toplevel
  with open(partial[cache_lib.TOKENS_FILE], "wb") as tok, open(partial[MASK_FILE], "wb") as mask:
    writer = _Writer(tokenizer, tok, mask)
    for path in tqdm(files, desc=f"tokenizing {len(files)} files", disable=not progress):
      pending = []
      for where, record in _records(path):
        try:
          if isinstance(record, chat.Skip):
            raise record
          text, spans, plain = chat.record_text(record, data.format, template)
          if not documents.is_unicode(text):
            raise chat.Skip("a lone UTF-16 surrogate (half of a character)")
          pending.append((where, text, spans, plain))
        except chat.Skip as reason:
          writer.skip(where, str(reason))
        if len(pending) == tokens_lib.ENCODE_BATCH:
          writer.add(pending)
          pending = []
      writer.add(pending)
  return writer


def _tokenize(files, tokenizer, template, data, cache: pathlib.Path, header: dict,
              progress: bool) -> dict:
  """Writes the token, mask and offset files, then the index (each by atomic rename)."""
  partial = {name: cache / f"{name}.tmp" for name in (cache_lib.TOKENS_FILE, MASK_FILE)}
  with cache_lib.remove_on_failure(list(partial.values())):
    writer = _write_examples(files, tokenizer, template, data, partial, progress)
    n_examples = len(writer.starts) - 1
    if not n_examples:
      reasons = "; ".join(f"{k} ({v['count']}, first at {v['first']})"
                          for k, v in writer.skipped.items())
      raise DataError(f"data.source={data.source!r} holds no usable {data.format} example "
                      f"({reasons or 'no records'})")
  for name, path in partial.items():
    path.replace(cache / name)
  np.asarray(writer.starts, np.int64).tofile(cache / STARTS_FILE)
  index = dict(header, tokenizer=tokenizer.name, vocab_size=tokenizer.vocab_size,
               dtype=tokenizer.dtype.name, tokens=writer.starts[-1], examples=n_examples,
               skipped=writer.skipped)
  write_json_atomic(cache / cache_lib.INDEX_FILE, index)
  return index


# ----------------------------------------------------------------------------- rows


def pack(lengths: np.ndarray, capacity: int) -> list[list[int]]:
  """Best-fit decreasing: each example (longest first) goes into the row it fills
  most closely, else a new row. Rows list their examples in input order."""
  rows: list[list[int]] = []
  free: list[tuple[int, int]] = []  # (positions left, row), sorted
  for i in np.argsort(-lengths, kind="stable"):
    n = int(lengths[i])
    j = bisect.bisect_left(free, (n, -1))
    if j == len(free):
      rows.append([int(i)])
      left, row = capacity - n, len(rows) - 1
    else:
      left, row = free.pop(j)
      rows[row].append(int(i))
      left -= n
    if left:
      bisect.insort(free, (left, row))
  return [sorted(r) for r in rows]


class ExampleBatches:
  """Batches of rows of examples, ``{tokens, loss_mask[, segment_ids]}`` each
  [grad_accum, micro_batch, seq_len + 1], by step (``order="epochs"``), or the first
  rows in a fixed order (``"fixed"``: held-out batches)."""

  def __init__(self, examples: Examples, seq_len: int, grad_accum: int, micro_batch: int,
               seed: int, *, packing: bool, overlong: str = "truncate", order: str = "epochs"):
    window = seq_len + 1
    self.examples, self.seed, self.order = examples, seed, order
    self.shape = (grad_accum, micro_batch, window)
    self.keys = batch_keys(packing)
    starts = examples.starts[:-1]
    lengths = np.diff(examples.starts)
    long = lengths > window
    self.dropped = dict(_count(long, "longer than train.seq_len+1") if overlong == "drop" else {})
    lengths = np.minimum(lengths, window)
    keep = ~long if overlong == "drop" else np.ones(len(lengths), bool)
    # Truncation may cut every target away.
    has_target = np.array([examples.mask[s + 1:s + n].any() for s, n in zip(starts, lengths)],
                          bool)
    self.dropped.update(_count(keep & ~has_target, "no target within train.seq_len+1"))
    keep &= has_target
    self.truncated = int((long & keep).sum())  # of the examples kept
    if not keep.any():
      raise DataError(f"no example fits train.seq_len={seq_len} with data.overlong={overlong!r}"
                      f" ({sum(self.dropped.values())} dropped)")
    self.starts, self.lengths = starts[keep], lengths[keep]
    ids = np.arange(keep.sum())
    self.rows = pack(self.lengths, window) if packing else [[i] for i in ids]
    if order == "fixed":
      # Held-out rows in the examples' own order, as without packing: pack's rows come
      # longest example first, and the first rows alone would be the longest examples'.
      self.rows.sort(key=lambda examples: examples[0])

  @property
  def n_rows(self) -> int:
    """Rows in an epoch."""
    return len(self.rows)

  rows_per_epoch = n_rows  # (jaxzero.data.batches.Batches' name for it)

  @property
  def n_tokens(self) -> int:
    """Tokens in the rows (padding not counted)."""
    return int(self.lengths.sum())

  @property
  def fill(self) -> float:
    """The fraction of row positions that hold a token rather than padding."""
    return self.n_tokens / (self.n_rows * self.shape[2])

  def __call__(self, step: int, rows: slice = slice(None)) -> dict[str, np.ndarray]:
    accum, batch, window = self.shape
    if self.order == "epochs":
      index = batches_lib.epoch_order(step, accum, batch, rows, self.n_rows, self.seed)
    else:
      index = batches_lib.fixed_order(accum, batch, rows, self.n_rows)
    out = {key: np.zeros((*index.shape, window), np.int32) for key in self.keys}
    for (a, b), row in np.ndenumerate(index):
      position = 0
      for segment, example in enumerate(self.rows[row], 1):
        start, n = self.starts[example], self.lengths[example]
        out["tokens"][a, b, position:position + n] = self.examples.tokens[start:start + n]
        out["loss_mask"][a, b, position:position + n] = self.examples.mask[start:start + n]
        if "segment_ids" in out:
          out["segment_ids"][a, b, position:position + n] = segment
        position += n
    return out


def batch_keys(packing: bool) -> tuple[str, ...]:
  """The arrays of a fine-tuning batch: one example per row needs no segment ids (it
  is causal and padding comes after it), so the cuDNN attention stays available."""
  return ("tokens", "loss_mask", "segment_ids") if packing else ("tokens", "loss_mask")


def _count(where: np.ndarray, reason: str) -> dict[str, int]:
  return {reason: int(where.sum())} if where.any() else {}
