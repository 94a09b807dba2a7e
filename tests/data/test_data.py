"""Token data: tokenizing files once into a cache, batches by step (also as one
global array over the 8 virtual CPU devices), bad input.

The tokenizer is a tiny word-level one trained here on the test corpus, with
a post-processor that starts each document with ``<s>`` as Llama's does.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxzero.config import DataConfig
from jaxzero.data import batches as batches_lib
from jaxzero.data import documents as documents_lib
from jaxzero.data import sources
from jaxzero.data import tokens as tokens_lib
from jaxzero.errors import DataError
from jaxzero.parallel.mesh import AXES, make_mesh

DOCS_TXT = ["the quick brown fox\njumps over the lazy dog\n", "a dog and a fox\n"]
DOCS_JSONL = ["the dog sleeps", "", "a quick fox runs over the dog"]
DOCS_PARQUET = ["brown dogs and lazy foxes", "the end"]


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
  tokenizers = pytest.importorskip("tokenizers")
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="<unk>"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  trainer = tokenizers.trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>"])
  tok.train_from_iterator(DOCS_TXT + DOCS_JSONL + DOCS_PARQUET, trainer)
  tok.post_processor = tokenizers.processors.TemplateProcessing(
      single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
  path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
  tok.save(str(path))
  return path


@pytest.fixture
def corpus(tmp_path):
  root = tmp_path / "corpus"
  (root / "txt").mkdir(parents=True)
  for i, text in enumerate(DOCS_TXT):
    (root / "txt" / f"{i}.txt").write_text(text)
  (root / "b.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n"
                                        for i, t in enumerate(DOCS_JSONL)) + "\n")
  pq = pytest.importorskip("pyarrow.parquet")
  pa = pytest.importorskip("pyarrow")
  pq.write_table(pa.table({"text": DOCS_PARQUET}), root / "c.parquet")
  (root / "README.md").write_text("not data: skipped when the source is a directory")
  return root


def config(source, tokenizer="byte", **kw) -> DataConfig:
  return DataConfig(source=str(source), tokenizer=str(tokenizer), **kw)


def documents(tokens: np.ndarray, eos: int) -> list[list[int]]:
  ends = np.flatnonzero(tokens == eos)
  assert ends.size and ends[-1] == tokens.size - 1  # every document is closed
  return [d.tolist() for d in np.split(tokens, ends + 1)[:-1]]


# ----------------------------------------------------------------------------- tokenizing


def test_every_format_tokenized_in_file_order(corpus, tokenizer_file, tmp_path):
  from tokenizers import Tokenizer
  tok = Tokenizer.from_file(str(tokenizer_file))
  source = tokens_lib.open_tokens(config(corpus, tokenizer_file), tmp_path / "run", progress=False)
  assert source.vocab_size == tok.get_vocab_size() and source.order == "epochs"
  assert source.tokens.dtype == np.uint8 and isinstance(source.tokens, np.memmap)
  assert source.cache.parent == tmp_path / "run" / "data_cache"
  # Sorted paths: b.jsonl, c.parquet, txt/0.txt, txt/1.txt; the empty JSON document is dropped.
  texts = [t for t in DOCS_JSONL if t] + DOCS_PARQUET + DOCS_TXT
  want = [tok.encode(t).ids + [tok.token_to_id("</s>")] for t in texts]
  assert documents(np.asarray(source.tokens), tok.token_to_id("</s>")) == want
  assert want[0][0] == tok.token_to_id("<s>")
  index = json.loads((source.cache / tokens_lib.INDEX_FILE).read_text())
  assert index["tokens"] == sum(map(len, want))
  assert index["tokenizer_sha256"] == hashlib.sha256(tokenizer_file.read_bytes()).hexdigest()
  assert [f["documents"] for f in index["files"]] == [2, 2, 1, 1]


def test_byte_level_text_file_is_its_bytes_then_nul(tmp_path):
  path = tmp_path / "one.txt"
  path.write_text("héllo\n")
  source = tokens_lib.open_tokens(config(path, cache_dir=tmp_path / "cache"), None, progress=False)
  assert np.asarray(source.tokens).tobytes() == "héllo\n".encode() + b"\0"
  assert source.vocab_size == 256


def _trained(kind: str, text: str, template: str = "<s> $A"):
  """A tiny BPE tokenizer of a Llama family, its documents `template` (the separator is
  </s>): byte-level (Llama 3), SentencePiece's Metaspace, or the legacy SentencePiece
  normalizer that Llama 2 and Mistral v0.1 ship ("▁" before every text, spaces as "▁")."""
  tokenizers = pytest.importorskip("tokenizers")
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet() if kind == "byte_level" else []
  tok.pre_tokenizer = (tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
                       if kind == "byte_level" else tokenizers.pre_tokenizers.Metaspace())
  tok.train_from_iterator([text], tokenizers.trainers.BpeTrainer(
      vocab_size=300, special_tokens=["<s>", "</s>"], initial_alphabet=alphabet))
  if kind == "legacy":  # (trained within words, as SentencePiece trains)
    tok.pre_tokenizer = None
    tok.normalizer = tokenizers.normalizers.Sequence([
        tokenizers.normalizers.Prepend("▁"), tokenizers.normalizers.Replace(" ", "▁")])
  tok.post_processor = tokenizers.processors.TemplateProcessing(
      single=template, special_tokens=[(t, tok.token_to_id(t)) for t in ("<s>", "</s>")])
  return tok


@pytest.mark.parametrize("kind, template", [("byte_level", "<s> $A"), ("metaspace", "<s> $A"),
                                            ("legacy", "<s> $A"), ("byte_level", "<s> $A </s>")])
def test_a_long_document_is_tokenized_in_bounded_pieces_as_it_is_whole(kind, template,
                                                                       tmp_path, monkeypatch):
  """A .txt file (which may be one line) or a long .jsonl record reaches the tokenizer in
  pieces of about TEXT_CHUNK characters, in calls of about ENCODE_CHARS: its memory is
  60 bytes a character, and a 1 GB file was one call. The pieces end where the tokenizer
  splits words, so the tokens are the whole text's; a tokenizer that ends a text with
  </s> ends the document with it, not its first piece."""
  rng = np.random.default_rng(0)
  words = ["the", "fox", "naïve", "12345", "(x)", "don't", "\t", ""]
  line = lambda n: " ".join(rng.choice(words, n))
  # Short lines, then one line of 40 pieces' length.
  text = "\n".join([line(int(n)) for n in rng.integers(0, 30, 60)] + [line(700), "", "end"])
  tok = _trained(kind, text, template)
  tok.save(str(tmp_path / "tokenizer.json"))
  monkeypatch.setattr(documents_lib, "TEXT_CHUNK", 64)
  monkeypatch.setattr(tokens_lib, "ENCODE_CHARS", 256)
  calls = []
  def spied(*args):
    tokenizer = load_tokenizer(*args)
    encode = lambda texts, start: calls.append(sum(map(len, texts))) or tokenizer.encode(
        texts, start)
    return dataclasses.replace(tokenizer, encode=encode)
  load_tokenizer = tokens_lib.load_tokenizer
  monkeypatch.setattr(tokens_lib, "load_tokenizer", spied)
  for path in (write(tmp_path / "doc.txt", text),
               write(tmp_path / "doc.jsonl", json.dumps({"text": text}) + "\n")):
    pieces = list(documents_lib.pieces(path, "text"))
    assert "".join(p.text for p in pieces) == text
    assert len(pieces) > 40 and max(len(p.text) for p in pieces) <= 3 * 64
    source = tokens_lib.open_tokens(config(path, tmp_path / "tokenizer.json"),
                                    tmp_path / path.suffix, progress=False)
    want = tok.encode(text).ids + ([] if template.endswith("</s>") else [tok.token_to_id("</s>")])
    assert np.asarray(source.tokens).tolist() == want, path
    assert len(calls) > 10 and max(calls) <= 256 + 3 * 64
    calls.clear()


def test_a_tokenizer_that_cannot_encode_the_probe_text_loads(tmp_path):
  """What encoding needs is probed at load ("a", "a b"); a word-level tokenizer whose unknown
  token is missing raises on those, and loads all the same."""
  tokenizers = pytest.importorskip("tokenizers")
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"hello": 0, "</s>": 1},
                                                         unk_token="[UNK]"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tok.save(str(tmp_path / "tokenizer.json"))
  loaded = tokens_lib.load_tokenizer(str(tmp_path / "tokenizer.json"))
  assert loaded.end_tokens == () and loaded.encode(["hello hello"], True) == [[0, 0]]


def test_cache_is_reused_until_a_source_file_changes(corpus, tokenizer_file, tmp_path,
                                                    monkeypatch):
  calls = []
  tokenize = tokens_lib._tokenize  # pylint: disable=protected-access
  monkeypatch.setattr(tokens_lib, "_tokenize", lambda *a, **k: calls.append(1) or tokenize(*a, **k))
  cfg = config(f"{corpus}/**/*.jsonl", tokenizer_file, cache_dir=tmp_path / "shared")
  first = np.array(tokens_lib.open_tokens(cfg, None, progress=False).tokens)
  again = tokens_lib.open_tokens(cfg, None, progress=False)
  assert len(calls) == 1 and np.array_equal(again.tokens, first)

  with open(corpus / "b.jsonl", "a") as f:
    f.write(json.dumps({"text": "lazy lazy dog"}) + "\n")
  changed = tokens_lib.open_tokens(cfg, None, progress=False)
  assert len(calls) == 2 and changed.tokens.size > first.size
  assert changed.cache == again.cache  # same entry, rewritten
  tokens_lib.open_tokens(dataclasses.replace(cfg, tokenizer="byte"), None, progress=False)
  assert len(calls) == 3  # another tokenizer gets its own entry ...
  tokens_lib.open_tokens(cfg, None, progress=False)
  assert len(calls) == 3  # ... and leaves this one valid
  # Replaced by a file of the same size and modification time (cp -p, rsync -t, tar):
  # another file all the same (its inode and change time differ).
  import os  # pylint: disable=import-outside-toplevel
  stat = (corpus / "b.jsonl").stat()
  replacement = corpus / "b.new"
  replacement.write_bytes((corpus / "b.jsonl").read_bytes().replace(b"lazy", b"LAZY"))
  os.utime(replacement, ns=(stat.st_atime_ns, stat.st_mtime_ns))
  replacement.replace(corpus / "b.jsonl")
  tokens_lib.open_tokens(cfg, None, progress=False)
  assert len(calls) == 4


# ----------------------------------------------------------------------------- batches


def batch_hashes(batches: batches_lib.Batches, steps) -> list[str]:
  return [hashlib.sha256(batches(s).tobytes()).hexdigest() for s in steps]


def test_resumed_run_sees_the_same_batches(corpus, tokenizer_file, tmp_path):
  cfg = config(corpus, tokenizer_file)

  def run_batches():  # what a (re)started trainer builds
    source = tokens_lib.open_tokens(cfg, tmp_path, progress=False)
    return batches_lib.Batches(source.tokens, seq_len=6, grad_accum=2, micro_batch=4, seed=7,
                        order=source.order)

  uninterrupted = batch_hashes(run_batches(), range(12))  # > 1 epoch of 11 windows
  resumed = batch_hashes(run_batches(), range(5, 12))
  assert resumed == uninterrupted[5:]
  assert len(set(uninterrupted)) == 12
  # Each process reads only its rows; together they are the global batch.
  batches = run_batches()
  shares = [batches(9, slice(r, r + 1)) for r in range(4)]
  assert np.array_equal(np.concatenate(shares, axis=1), batches(9))


def test_epochs_visit_every_window_once_in_a_new_order():
  tokens = np.arange(1000, dtype=np.uint16)
  batches = batches_lib.Batches(tokens, seq_len=9, grad_accum=2, micro_batch=4, seed=0,
                                order="epochs")
  assert batches.n_windows == 111
  rows = np.concatenate([batches(s).reshape(-1, 10) for s in range(28)])  # 224 samples
  assert np.array_equal(rows[:, 1:] - rows[:, :-1], np.ones((224, 9)))  # contiguous windows
  epoch0, epoch1 = rows[:111, 0], rows[111:222, 0]
  assert sorted(epoch0) == sorted(epoch1) == list(range(0, 999, 9))
  assert not np.array_equal(epoch0, epoch1)


def test_permutation_is_a_bijection():
  for n in (1, 2, 5, 64, 1000):
    assert sorted(batches_lib.permute(np.arange(n), n, (3, 0)).tolist()) == list(range(n))


@pytest.mark.parametrize("spec", [P(None, AXES, None), P(None, "fsdp", None)],
                         ids=["over_all_8", "replicated_over_replica"])
def test_global_batch_is_the_step_batch_with_the_given_sharding(spec):
  batches = batches_lib.Batches(np.arange(1000, dtype=np.uint16), seq_len=9, grad_accum=2,
                                micro_batch=8, seed=3, order="epochs")
  sharding = NamedSharding(make_mesh(2, 4, jax.devices()[:8]), spec)
  batch = batches_lib.global_batch(batches, sharding, 5)
  assert batch.sharding == sharding and batch.shape == batches.shape
  assert np.array_equal(np.asarray(batch), batches(5))


def test_stdlib_batches_are_unchanged():
  source = tokens_lib.open_tokens(DataConfig(max_bytes=50_000), None)
  assert source.order == "random" and source.vocab_size == 256
  assert source.tokens.dtype == np.uint8 and source.tokens.size == 50_000
  batches = batches_lib.Batches(source.tokens, 16, 2, 3, seed=5)
  rng = np.random.default_rng([5, 4])
  starts = rng.integers(0, source.tokens.size - 17, size=(2, 3))
  assert np.array_equal(batches(4), source.tokens[starts[..., None] + np.arange(17)])


# ----------------------------------------------------------------------------- bad input


def write(path, text):
  path.write_text(text)
  return path


@pytest.mark.parametrize("case, message", [
    ("no_match", "nothing/*.jsonl' is neither 'stdlib' nor a file, directory or glob"),
    ("wrong_suffix", "notes.csv, which is not one of .txt, .jsonl, .parquet"),
    ("bad_json", "bad.jsonl:2: not valid JSON"),
    ("no_field", "bad.jsonl:1: no 'text' field (found 'body'); set data.text_field"),
    ("no_column", "c.parquet: no column 'body' (columns: text); set data.text_field"),
    ("no_tokenizer", "missing.json'"),
    ("no_eos", "set data.eos_token"),
    ("unknown_eos", "data.eos_token='<end>' is not a token"),
    ("vocab_too_big", "has 256 tokens but model.vocab_size=100"),
    ("stdlib_tokenizer", "data.source='stdlib' is byte-level"),
])
def test_bad_input_is_one_line_naming_the_culprit(case, message, corpus, tokenizer_file,
                                                 tmp_path):
  from tokenizers import Tokenizer
  no_eos = tmp_path / "no_eos.json"
  # The same tokenizer with its end-of-text token renamed to an unusual name.
  no_eos.write_text(Tokenizer.from_file(str(tokenizer_file)).to_str().replace('"</s>"', '"<x>"'))
  cases = {  # built lazily: some write files
      "no_match": lambda: (config(tmp_path / "nothing" / "*.jsonl"), None),
      "wrong_suffix": lambda: (config(write(tmp_path / "notes.csv", "a,b")), None),
      "bad_json": lambda: (config(write(tmp_path / "bad.jsonl", '{"text": "a"}\n{oops\n')), None),
      "no_field": lambda: (config(write(tmp_path / "bad.jsonl", '{"body": "a"}\n')), None),
      "no_column": lambda: (config(corpus / "c.parquet", text_field="body"), None),
      "no_tokenizer": lambda: (config(corpus, tmp_path / "missing.json"), None),
      "no_eos": lambda: (config(corpus, no_eos), None),
      "unknown_eos": lambda: (config(corpus, tokenizer_file, eos_token="<end>"), None),
      "vocab_too_big": lambda: (config(corpus / "txt"), 100),
      "stdlib_tokenizer": lambda: (config("stdlib", tokenizer_file), None),
  }
  cfg, vocab = cases[case]()
  with pytest.raises(DataError) as info:
    tokens_lib.open_tokens(cfg, tmp_path / "run", model_vocab_size=vocab, progress=False)
  assert message in str(info.value) and "\n" not in str(info.value)
  if case == "vocab_too_big":  # refused before a file is tokenized
    assert not (tmp_path / "run" / "data_cache").exists()


@pytest.mark.parametrize("source, eval_source, message", [
    ("corpus", "corpus/txt/0.txt", "data.eval_source='{root}/txt/0.txt' names 1 file(s) that "
                                   "data.source='{root}' trains on too (first {root}/txt/0.txt)"),
    ("corpus/b.jsonl", "corpus/*.jsonl", "names 1 file(s) that data.source='{root}/b.jsonl'"),
    ("corpus/txt", "corpus/nothing.txt", "data.eval_source='{root}/nothing.txt' is neither a file"),
    ("corpus/link", "corpus/b.jsonl", "names 1 file(s) that data.source='{root}/link'"),
    ("stdlib", "stdlib", "data.source='stdlib' trains on it; hold out data.eval_fraction"),
])
def test_a_held_out_source_that_training_reads_or_that_names_nothing_is_one_line(
    source, eval_source, message, corpus):
  """Checked before anything is tokenized; the line names data.eval_source."""
  from jaxzero.data import pipeline
  (corpus / "link").symlink_to(corpus)  # the same files, by another path
  place = lambda path: path if path == "stdlib" else str(corpus.parent / path)
  with pytest.raises(DataError) as info:
    pipeline.check_held_out_apart(config(place(source), eval_source=place(eval_source)))
  assert message.format(root=corpus) in str(info.value) and "\n" not in str(info.value)


def test_the_standard_library_as_held_out_text_for_your_own_files_is_allowed(corpus):
  from jaxzero.data import pipeline
  pipeline.check_held_out_apart(config(corpus, eval_source="stdlib"))


def test_a_held_out_sources_errors_name_data_eval_source(corpus, tmp_path):
  from jaxzero.data import pipeline
  empty = tmp_path / "held_out"
  empty.mkdir()
  (empty / "a.txt").write_text("")
  from jaxzero import config as config_lib
  run = config_lib.apply_overrides(config_lib.base(), [
      f"data.source={corpus / 'txt'}", f"data.eval_source={empty}",
      f"data.cache_dir={tmp_path / 'cache'}"])
  with pytest.raises(DataError, match="files of data.eval_source hold no text"):
    pipeline.open_data(run, tmp_path, 8, progress=False)


def test_a_training_split_too_short_after_the_held_out_part_names_eval_fraction(corpus,
                                                                                  tmp_path):
  from jaxzero.data import pipeline
  from jaxzero import config as config_lib
  run = config_lib.apply_overrides(config_lib.base(), [
      f"data.source={corpus / 'txt'}", "data.eval_fraction=0.99999",
      f"data.cache_dir={tmp_path / 'cache'}"])
  with pytest.raises(DataError, match=r"the training split, after data.eval_fraction=0.99999 "
                     r"of [\d,]+ tokens is held out: corpus has \d+ tokens, fewer than"):
    pipeline.open_data(run, tmp_path, 8, progress=False)


def test_a_directory_names_each_file_once_however_links_reach_it(tmp_path, caplog):
  """Links to directories are not followed (a loop hung the search, an alias repeated
  files); a linked source directory works (it crashed); a file's name with glob
  characters is that file; suffixes in any case count, other files are named as left
  out; the run's own directories are never its data."""
  import logging  # pylint: disable=import-outside-toplevel
  root = tmp_path / "corpus"
  (root / "sub").mkdir(parents=True)
  for name in ("a.txt", "B.TXT", "data1.txt", "data[1].txt", "notes.md", "sub/c.txt"):
    (root / name).write_text(f"text of {name}\n")
  (root / "sub" / "up").symlink_to("..")  # a loop
  (root / "alias").symlink_to("sub")  # the same files again
  (root / "run" / "checkpoints").mkdir(parents=True)
  (root / "run" / "metrics.jsonl").write_text('{"step": 1}\n')  # a workdir inside it
  (tmp_path / "link").symlink_to(root)
  names = lambda files: [str(p.relative_to(root)) for p in files]
  with caplog.at_level(logging.WARNING):
    found = sources.match_files(str(tmp_path / "link"),
                                   exclude=sources.run_outputs(DataConfig(), root / "run"))
  assert [str(p.relative_to(tmp_path / "link")) for p in found] == [
      "B.TXT", "a.txt", "data1.txt", "data[1].txt", "sub/c.txt"]
  assert "holds 1 file(s) that are not .txt, .jsonl, .parquet, left out" in caplog.text
  assert "reaches 1 file(s) a run writes" in caplog.text
  assert names(sources.match_files(str(root / "data[1].txt"))) == ["data[1].txt"]
  assert len(sources.match_files(str(root / "**" / "*.txt"))) == 4  # each file once
  # The held-out-name warning of a linked directory source (it raised ValueError).
  from jaxzero.data import pipeline  # pylint: disable=import-outside-toplevel
  warn = pipeline._warn_of_held_out_files  # pylint: disable=protected-access
  warn(DataConfig(source=str(tmp_path / "link")))


def test_a_byte_order_mark_is_no_text_and_an_undecodable_byte_is_found_in_the_file(tmp_path):
  plain = tokens_lib.open_tokens(config(write(tmp_path / "a.txt", "hello\n"),
                                        cache_dir=tmp_path / "c1"), None, progress=False).tokens
  for name, data in (("b.txt", b"\xef\xbb\xbfhello\n"),
                     ("b.jsonl", b'\xef\xbb\xbf{"text": "hello\\n"}\n')):
    (tmp_path / name).write_bytes(data)
    marked = tokens_lib.open_tokens(config(tmp_path / name, cache_dir=tmp_path / name[2:]),
                                    None, progress=False).tokens
    assert np.array_equal(marked, plain), name
  # The progress bar ends at the file's size: the last piece counts the mark and the \r's.
  (tmp_path / "crlf.txt").write_bytes(b"\xef\xbb\xbf" + b"hello world\r\n" * 1000)
  pieces = list(documents_lib.pieces(tmp_path / "crlf.txt", "text"))
  assert sum(p.size for p in pieces) == 13_003 and len(pieces) > 1
  # Past the text reader's buffer: the offset is the file's (it was the buffer's).
  (tmp_path / "bad.txt").write_bytes(b"x" * 99_999 + b"\n" + b"abc\xff")
  with pytest.raises(DataError, match=r"bad.txt: not UTF-8 text \(invalid start byte at byte "
                                      r"100,003, line 2\)"):
    tokens_lib.open_tokens(config(tmp_path / "bad.txt", cache_dir=tmp_path / "c3"), None,
                           progress=False)


def test_a_parquet_file_whose_data_page_is_damaged_is_one_line(tmp_path):
  pq = pytest.importorskip("pyarrow.parquet")
  pa = pytest.importorskip("pyarrow")
  path = tmp_path / "d.parquet"
  pq.write_table(pa.table({"text": ["hello world"] * 1000}), path)
  damaged = bytearray(path.read_bytes())
  damaged[4:40] = b"\x07" * 36  # the first page's header; the footer still reads
  path.write_bytes(bytes(damaged))
  with pytest.raises(DataError, match=r"d.parquet: not a readable Parquet file \(.*page header"):
    tokens_lib.open_tokens(config(path, cache_dir=tmp_path / "c"), None, progress=False)

