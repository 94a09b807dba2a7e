"""The documents of a data file, as text in pieces of about TEXT_CHUNK characters: a .txt
file is one document, a .jsonl line or a Parquet row one (its data.text_field).

Invariants: a document's pieces, joined, are its text; in text with spaces, pieces end where
byte-level and SentencePiece tokenizers split words, so tokenizing them one by one gives
the whole document's tokens; a file that is not what its suffix says is one DataError
naming the file and, where known, the line.
"""

from __future__ import annotations

import codecs
import json
import pathlib
from typing import Callable, Iterable, Iterator, NamedTuple

from jaxzero.errors import DataError

# Documents are tokenized in pieces of about this many characters (see _cut).
TEXT_CHUNK = 1 << 16
# Parquet rows read at a time.
PARQUET_ROWS = 1024


class Piece(NamedTuple):
  """Part of a document; a document is its pieces in order."""
  text: str
  first: bool  # begins a document: the tokenizer adds its start tokens
  last: bool  # ends a document: the separator follows
  size: int  # bytes of the source file it accounts for (progress)

  @property
  def empty(self) -> bool:
    """An empty document, skipped; an empty last piece still ends its document."""
    return self.first and not self.text


def pieces(path: pathlib.Path, text_field: str) -> Iterator[Piece]:
  reader = {".txt": text_pieces, ".jsonl": jsonl_pieces, ".parquet": parquet_pieces}
  return reader[path.suffix.lower()](path, text_field)


def text_pieces(path: pathlib.Path, _field: str) -> Iterator[Piece]:
  """A .txt file is one document, read TEXT_CHUNK characters at a time (a file may be one
  long line)."""
  try:
    with open(path, encoding="utf-8-sig") as f:  # (a byte-order mark is no text)
      # The last piece counts what decoding dropped (a byte-order mark, the \r of \r\n), so
      # that the progress bar ends at the file's size.
      counted, size = 0, path.stat().st_size
      for text, first, last in _cut(iter(lambda: f.read(TEXT_CHUNK), "")):
        piece = Piece(text, first, last, size - counted if last else len(text.encode()))
        counted += piece.size
        yield piece
  except UnicodeDecodeError as e:
    offset = _first_undecodable_byte(path)
    raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {offset:,}, line "
                    f"{_line_of(path, offset):,})") from None


def _record_pieces(text: str, size: int) -> Iterator[Piece]:
  """One record's document (a .jsonl line's, a Parquet row's), in pieces where it is long;
  its `size` in the file is counted on its last."""
  if len(text) <= TEXT_CHUNK:
    yield Piece(text, True, True, size)
    return
  blocks = (text[i:i + TEXT_CHUNK] for i in range(0, len(text), TEXT_CHUNK))
  for piece, first, last in _cut(blocks):
    yield Piece(piece, first, last, size if last else 0)


def _cut(blocks: Iterable[str]) -> Iterator[tuple[str, bool, bool]]:
  """A document's text, given in blocks, as pieces (text, first, last) of about a block
  each, ending where byte-level and SentencePiece tokenizers split words anyway
  (_piece_end): each piece tokenizes as it does in the whole, and no tokenizer call (nor
  its memory, about 60 bytes a character) grows with the document."""
  held, first = "", True
  for block in blocks:
    text = held + block
    cut = _piece_end(text)
    if cut:
      yield text[:cut], first, False
      first = False
    held = text[cut:]
  if held or not first:
    yield held, first, True


def _piece_end(text: str) -> int:
  """Where a piece of `text` ends: before its last space that follows a word (the space
  begins the next word's token), else after its last newline that a word follows. What
  follows waits for more text, or is the last piece; text without either is cut at
  2 x TEXT_CHUNK characters."""
  space = _last(text, " ", lambda i: not text[i - 1].isspace())
  if space > 0:
    return space
  newline = _last(text[:-1], "\n", lambda i: not text[i + 1].isspace())
  if newline >= 0:
    return newline + 1
  return len(text) if len(text) >= 2 * TEXT_CHUNK else 0


def _last(text: str, char: str, wanted: Callable[[int], bool]) -> int:
  """The last index i > 0 of `char` in `text` with wanted(i), else -1."""
  end = len(text)
  while (i := text.rfind(char, 1, end)) > 0:
    if wanted(i):
      return i
    end = i
  return -1


def _first_undecodable_byte(path: pathlib.Path) -> int:
  """The file offset of the first byte that is not UTF-8 (the text reader's error counts
  from its buffer)."""
  decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
  with open(path, "rb") as f:
    while chunk := f.read(1 << 20):
      pending = len(decoder.getstate()[0])  # bytes of a character begun in the last chunk
      try:
        decoder.decode(chunk)
      except UnicodeDecodeError as e:
        return offset - pending + e.start
      offset += len(chunk)
  return offset


def _line_of(path: pathlib.Path, offset: int) -> int:
  with open(path, "rb") as f:
    return f.read(offset).count(b"\n") + 1


def jsonl_pieces(path: pathlib.Path, field: str) -> Iterator[Piece]:
  for line_no, line, size in jsonl_lines(path):
    text = _json_text(line, field, path, line_no) if line.strip() else ""
    yield from _record_pieces(text, size)


def jsonl_lines(path: pathlib.Path) -> Iterator[tuple[int, str, int]]:
  """(line number, its text, its bytes) of each line of a .jsonl file, decoded as UTF-8
  (not json.loads' guess line by line, which half-decoded a UTF-16 file); a byte-order
  mark is no JSON; a file that is not UTF-8 is one DataError naming the byte and line."""
  with open(path, "rb") as f:
    offset = 0
    for line_no, line in enumerate(f, 1):
      try:
        text = line.decode("utf-8-sig" if line_no == 1 else "utf-8")
      except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {offset + e.start:,}, "
                        f"line {line_no:,})") from None
      offset += len(line)
      yield line_no, text, len(line)


def _json_text(line: str, field: str, path: pathlib.Path, line_no: int) -> str:
  try:
    record = json.loads(line)
  except (ValueError, RecursionError) as e:  # (JSONDecodeError, a line nested too deep)
    raise DataError(f"{path}:{line_no}: not valid JSON ({e})") from None
  if not isinstance(record, dict) or field not in record:
    keys = ", ".join(map(repr, record)) if isinstance(record, dict) else type(record).__name__
    raise DataError(f"{path}:{line_no}: no {field!r} field (found {keys}); "
                    "set data.text_field")
  text = record[field]
  if not isinstance(text, str):
    raise DataError(f"{path}:{line_no}: field {field!r} is {type(text).__name__}, not a string")
  if not is_unicode(text):
    raise DataError(f"{path}:{line_no}: field {field!r} holds a lone UTF-16 surrogate (a "
                    "\\ud800-\\udfff escape, half of a character), which no tokenizer encodes")
  return text


def is_unicode(text: str) -> bool:
  """Whether `text` encodes as UTF-8: a JSON string can hold half of a surrogate pair."""
  try:
    text.encode()
  except UnicodeEncodeError:
    return False
  return True


def open_parquet(path: pathlib.Path):
  """A pyarrow ParquetFile, or one line naming what is wrong."""
  try:
    import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise DataError(f"{path}: reading Parquet needs pyarrow: "
                    "pip install 'jaxzero[parquet]'") from None
  try:
    return pq.ParquetFile(path)
  except Exception as e:  # pyarrow raises several types for a bad file
    raise DataError(f"{path}: not a readable Parquet file ({_one_line(e)})") from None


def _one_line(error: BaseException) -> str:
  return " ".join(str(error).split())


def parquet_pieces(path: pathlib.Path, column: str) -> Iterator[Piece]:
  table = open_parquet(path)
  names = table.schema_arrow.names
  if column not in names:
    raise DataError(f"{path}: no column {column!r} (columns: {', '.join(names)}); "
                    "set data.text_field")
  rows = max(table.metadata.num_rows, 1)
  bytes_per_row = path.stat().st_size / rows
  batches = table.iter_batches(batch_size=PARQUET_ROWS, columns=[column])
  while True:
    try:
      batch = next(batches, None)
    except Exception as e:  # pylint: disable=broad-except  # pyarrow's, for a damaged page
      raise DataError(f"{path}: not a readable Parquet file ({_one_line(e)})") from None
    if batch is None:
      return
    for text in batch.column(0).to_pylist():
      if text is not None and not isinstance(text, str):
        raise DataError(f"{path}: column {column!r} holds {type(text).__name__}, not strings")
      yield from _record_pieces(text or "", int(bytes_per_row))
