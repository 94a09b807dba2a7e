"""Token streams: the embedded corpus or your own files, tokenized once into a cache.

``data.source`` is ``"stdlib"`` (the Python standard library's source files as bytes,
vocabulary 256) or a path, directory or glob of ``.txt``, ``.jsonl`` or ``.parquet`` files
(jaxzero.data.sources, read by jaxzero.data.documents), tokenized once with
``data.tokenizer`` into a memory-mapped token file plus a JSON index in ``data.cache_dir``.
The cache is reused only while the index matches the source files (paths, sizes,
modification and change times, inodes) and the tokenizer (content hash). Documents are
joined into one stream, each followed by the tokenizer's end-of-text token (NUL for
bytes); jaxzero.data.batches cuts it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import pathlib
import sysconfig
from typing import Callable, NamedTuple

import numpy as np

from jaxzero.data.cache import (INDEX_FILE, TOKENS_FILE, cache_name, cache_root, cached,
                                index_header, read_index, remove_on_failure)
from jaxzero.data import documents, sources
from jaxzero.errors import DataError
from jaxzero.utils.files import write_json_atomic


BYTE_VOCAB = 256
# NUL never occurs in text, so it is the byte-level document separator.
BYTE_SEPARATOR = 0
# End-of-document tokens of common tokenizer families, tried in this order:
# Llama 3, GPT-2/NeoX/Qwen, Llama 1-2/Mistral, Gemma.
EOS_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>")
# Pieces encoded per call of the tokenizer (it parallelises within a call), and at most
# about this many characters: its memory, about 60 bytes a character.
ENCODE_BATCH = 1024
ENCODE_CHARS = 1 << 23


class TokenSource(NamedTuple):
  """A token stream ready for jaxzero.data.batches.Batches."""
  tokens: np.ndarray  # 1-D, uint8/uint16/uint32; a read-only memmap for file sources
  vocab_size: int  # every token id is below this
  order: str  # "random" or "epochs": how Batches visits the stream
  cache: pathlib.Path | None = None  # directory of the token file, None for stdlib


def open_tokens(data, workdir: str | os.PathLike | None, *, model_vocab_size: int | None = None,
                progress: bool = True) -> TokenSource:
  """The token stream for a DataConfig, tokenizing the source files if needed.

  Args:
    data: jaxzero.config.DataConfig.
    workdir: the run directory; the token cache defaults to WORKDIR/data_cache.
    model_vocab_size: when given, a tokenizer whose ids do not fit the model's
      embedding is rejected here rather than as an index error mid-training.
    progress: show a progress bar while tokenizing.

  Raises:
    DataError: naming the setting, file or line that is wrong.
  """
  if data.source == "stdlib":
    if data.tokenizer != "byte":
      raise DataError(f"data.source='stdlib' is byte-level; data.tokenizer={data.tokenizer!r} "
                      "needs a source of your own files")
    check_vocab(data.tokenizer, BYTE_VOCAB, model_vocab_size)
    return TokenSource(stdlib_corpus(data.max_bytes), BYTE_VOCAB, "random")
  return _open_files(data, workdir, progress, model_vocab_size)


def check_vocab(tokenizer_name: str, vocab_size: int, model_vocab_size: int | None) -> None:
  """Refuses a tokenizer whose ids do not fit the model's embedding: once the tokenizer
  is loaded, before any file is tokenized."""
  if model_vocab_size is not None and vocab_size > model_vocab_size:
    raise DataError(f"data.tokenizer={tokenizer_name!r} has {vocab_size} tokens but "
                    f"model.vocab_size={model_vocab_size}; the model's vocabulary must be at "
                    "least the tokenizer's")


@functools.cache
def _stdlib_files(root: pathlib.Path) -> tuple[pathlib.Path, ...]:
  # Listed once a process: walking the whole standard library takes about 0.4 s, and a
  # process that trains several runs (an evaluation sweep, a test session) reads it each time.
  return tuple(sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts))


def stdlib_corpus(max_bytes: int) -> np.ndarray:
  """Bytes of the standard library's .py files, in a fixed (sorted) order."""
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  files = _stdlib_files(root)
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


# ----------------------------------------------------------------------------- tokenizers


@dataclasses.dataclass(frozen=True)
class TextTokenizer:
  name: str  # "byte" or the tokenizer.json path
  digest: str  # content hash: the cache is valid only for the same tokenizer
  vocab_size: int
  separator: tuple[int, ...]  # appended to every document
  # (texts, whether each begins a document) -> token ids per text; a text that does not
  # begin one continues the text before it (no start tokens, no word-start mark)
  encode: Callable[[list[str], bool], list]
  # The same, as (ids, each token's [start, end) characters in its text, whether the
  # tokenizer added it (a start token)) per text.
  encode_spans: Callable[[list[str], bool], list] | None = None
  # What encode adds after a text with its start tokens (a post-processor's "$A </s>"):
  # a document's end, so a document's first piece drops them and its last piece gains them.
  end_tokens: tuple[int, ...] = ()

  @property
  def dtype(self) -> np.dtype:
    return np.dtype(np.uint8 if self.vocab_size <= 1 << 8 else
                    np.uint16 if self.vocab_size <= 1 << 16 else np.uint32)


def load_tokenizer(name: str, eos_token: str = "", fine_tuning: str = "") -> TextTokenizer:
  """``"byte"``, or a Hugging Face ``tokenizer.json`` (or a directory holding one).

  Its separator, the end-of-text token: `eos_token` (data.eos_token) where given, else the
  first of EOS_NAMES it has. For `fine_tuning` records (data.format) the one its
  ``tokenizer_config.json`` names comes first, as TRL appends ``tokenizer.eos_token`` to a
  completion; a chat (rendered by its template, which ends its own turns) needs none.
  """
  if name == "byte":
    return TextTokenizer("byte", "byte", BYTE_VOCAB, (BYTE_SEPARATOR,),
                         lambda texts, _start: [np.frombuffer(t.encode(), np.uint8) for t in texts],
                         lambda texts, _start: [_byte_spans(t) for t in texts])
  path = pathlib.Path(name).expanduser()
  if path.is_dir():
    path = path / "tokenizer.json"
  if not path.is_file():
    raise DataError(f"data.tokenizer={name!r}: no such file; use 'byte' or the path of a "
                    "Hugging Face tokenizer.json")
  from tokenizers import Tokenizer  # pylint: disable=import-outside-toplevel
  blob = path.read_bytes()
  try:
    tokenizer = Tokenizer.from_str(blob.decode())
  except Exception as e:  # the Rust side raises its own exception type
    raise DataError(f"data.tokenizer={name!r}: not a Hugging Face tokenizer.json ({e})") from None
  # A tokenizer.json may carry settings for model inputs; documents must stay whole.
  tokenizer.no_truncation()
  tokenizer.no_padding()
  vocab = tokenizer.get_vocab(with_added_tokens=True)
  configured = _configured_eos(path) if fine_tuning else ""
  try:
    separator = (_eos_id(tokenizer, eos_token, name, configured),)
  except DataError:
    if fine_tuning != "chat" or eos_token:
      raise
    separator = ()

  marks_each_text = _marks_each_text(tokenizer)

  def encode(texts: list[str], start: bool) -> list[list[int]]:
    if not start and marks_each_text:  # its own mark stands for the space a piece starts at
      texts = [t[1:] if t.startswith(" ") else t for t in texts]
    return [e.ids for e in tokenizer.encode_batch_fast(texts, add_special_tokens=start)]

  def encode_spans(texts: list[str], start: bool) -> list[tuple[list[int], np.ndarray]]:
    return [(e.ids, np.asarray(e.offsets, np.int64).reshape(-1, 2),
             np.asarray(e.special_tokens_mask, bool))
            for e in tokenizer.encode_batch(texts, add_special_tokens=start)]

  return TextTokenizer(str(path.resolve()), hashlib.sha256(blob).hexdigest(),
                       max(vocab.values()) + 1, separator, encode, encode_spans,
                       _end_tokens(tokenizer))


def _end_tokens(tokenizer) -> tuple[int, ...]:
  """The tokens a Hugging Face tokenizer's post-processor adds after a text."""
  for probe in ("a", "the", "1", "x"):
    try:
      plain, full = (tokenizer.encode(probe, add_special_tokens=s).ids for s in (False, True))
    except Exception:  # pylint: disable=broad-except  # (a vocabulary without the probe)
      continue
    for lead in range(len(full) - len(plain) + 1) if plain else ():
      if full[lead:lead + len(plain)] == plain:
        return tuple(full[lead + len(plain):])
  return ()


def _marks_each_text(tokenizer) -> bool:
  """Whether the tokenizer marks every text it encodes as starting a word (the legacy
  SentencePiece normalizer of Llama 2 and Mistral v0.1 puts "▁" before each): a piece that
  continues a document at " word" then tokenizes as in the whole only without its space."""
  try:
    whole, first, spaced, bare = (tokenizer.encode(text, add_special_tokens=False).ids
                                  for text in ("a b", "a", " b", "b"))
  except Exception:  # pylint: disable=broad-except  # (a vocabulary without the probe)
    return False
  return whole != first + spaced and whole == first + bare


def named_token(tokenizer_config: dict, key: str) -> str:
  """The token a tokenizer_config.json names under `key` (eos_token, ...: a string, or an
  added token's {"content": ...}); "" where none."""
  token = tokenizer_config.get(key) if isinstance(tokenizer_config, dict) else None
  token = token.get("content") if isinstance(token, dict) else token
  return token if isinstance(token, str) else ""


def _configured_eos(path: pathlib.Path) -> str:
  """The eos_token the tokenizer_config.json beside `path` names ("" where none)."""
  try:
    named = json.loads((path.parent / "tokenizer_config.json").read_text(encoding="utf-8"))
  except (OSError, ValueError):
    return ""
  return named_token(named, "eos_token")


def _byte_spans(text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """A text's bytes with each one's character span (a character's bytes share it)."""
  ids = np.frombuffer(text.encode(), np.uint8)
  char = np.cumsum((ids & 0xC0) != 0x80) - 1  # UTF-8 continuation bytes are 10xxxxxx
  return ids, np.stack([char, char + 1], axis=1), np.zeros(ids.size, bool)


def _eos_id(tokenizer, eos_token: str, name: str, configured: str = "") -> int:
  """The document separator: data.eos_token if set, else `configured` (the tokenizer's
  own, for fine-tuning) or the first of EOS_NAMES present."""
  for token in ([eos_token] if eos_token else filter(None, (configured, *EOS_NAMES))):
    token_id = tokenizer.token_to_id(token)
    if token_id is not None:
      return token_id
  if eos_token:
    raise DataError(f"data.eos_token={eos_token!r} is not a token of data.tokenizer={name!r}")
  raise DataError(f"data.tokenizer={name!r} has none of the usual end-of-text tokens "
                  f"({', '.join(EOS_NAMES)}); set data.eos_token to the one that ends a document")


# ----------------------------------------------------------------------------- token cache


def _open_files(data, workdir, progress: bool, model_vocab_size: int | None) -> TokenSource:
  files = sources.match_files(data.source, exclude=sources.run_outputs(data, workdir))
  tokenizer = load_tokenizer(data.tokenizer, data.eos_token)
  check_vocab(data.tokenizer, tokenizer.vocab_size, model_vocab_size)
  cache = cache_root(data, workdir) / cache_name(data, tokenizer)
  want = index_header(files, tokenizer, data.text_field)
  index = cached(cache, want, read_index,
                 lambda: _tokenize(files, tokenizer, data.text_field, cache, want, progress))
  tokens = np.memmap(cache / TOKENS_FILE, dtype=index["dtype"], mode="r",
                     shape=(index["tokens"],))
  return TokenSource(tokens, tokenizer.vocab_size, "epochs", cache)


def _tokenize(files: list[pathlib.Path], tokenizer: TextTokenizer, text_field: str,
              cache: pathlib.Path, header: dict, progress: bool) -> dict:
  """Writes the token file and then its index (each by atomic rename)."""
  from tqdm import tqdm  # pylint: disable=import-outside-toplevel
  total = sum(f["bytes"] for f in header["files"])
  bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"tokenizing {len(files)} files",
             disable=not progress)
  partial = cache / f"{TOKENS_FILE}.{os.getpid()}.tmp"
  counts = []
  with remove_on_failure([partial]):
    with open(partial, "wb") as out, bar:
      for path in files:
        counts.append(_tokenize_file(path, tokenizer, text_field, out, bar))
    n_tokens = sum(c["tokens"] for c in counts)
    if n_tokens == 0:
      raise DataError(f"the {len(files)} files of data.source hold no text")
  os.replace(partial, cache / TOKENS_FILE)
  index = dict(header, tokenizer=tokenizer.name, vocab_size=tokenizer.vocab_size,
               dtype=tokenizer.dtype.name, tokens=n_tokens)
  index["files"] = [dict(entry, **count) for entry, count in zip(index["files"], counts)]
  write_json_atomic(cache / INDEX_FILE, index)
  return index


def _tokenize_file(path: pathlib.Path, tokenizer: TextTokenizer, text_field: str, out,
                   bar) -> dict:
  """Appends one file's tokens to `out`; returns its token and document counts."""
  counts = {"tokens": 0, "documents": 0}
  batch: list[documents.Piece] = []
  chars = 0
  for piece in documents.pieces(path, text_field):
    batch.append(piece)
    chars += len(piece.text)
    if len(batch) == ENCODE_BATCH or chars >= ENCODE_CHARS:
      _write_pieces(batch, tokenizer, out, counts, bar)
      batch, chars = [], 0
  _write_pieces(batch, tokenizer, out, counts, bar)
  return counts


def _write_pieces(pieces: list[documents.Piece], tokenizer: TextTokenizer, out, counts: dict,
                  bar) -> None:
  """Encodes pieces (start tokens only on first pieces) and appends them with separators."""
  encoded: list[np.ndarray | None] = [None] * len(pieces)
  end = list(tokenizer.end_tokens)
  for start in (True, False):
    chosen = [i for i, p in enumerate(pieces) if p.first == start and not p.empty]
    for i, ids in zip(chosen, tokenizer.encode([pieces[i].text for i in chosen], start)):
      if pieces[i].first != pieces[i].last:  # a document's end tokens end its last piece
        ids = ids[:len(ids) - len(end)] if pieces[i].first else [*ids, *end]
      encoded[i] = np.asarray(ids, tokenizer.dtype)
  sep = np.asarray(tokenizer.separator, tokenizer.dtype)
  parts = []
  for piece, ids in zip(pieces, encoded):
    if ids is None:  # an empty document: no tokens, no separator
      continue
    parts.append(ids)
    # Unless the tokenizer's post-processor already ended the document.
    if piece.last and not np.array_equal(ids[-sep.size:], sep):
      parts.append(sep)
    counts["documents"] += piece.last
  stream = np.concatenate(parts) if parts else sep[:0]
  out.write(stream.tobytes())
  counts["tokens"] += stream.size
  bar.update(sum(p.size for p in pieces))
