"""What an export carries besides the weights, from what the run's WORKDIR/config.json records.

The run's tokenizer (``data.tokenizer``) with the chat template it trained with
(``data.chat_template`` where set); ``config.json``'s fields that jaxzero does not model
(``max_position_embeddings``, the special tokens' ids) and ``generation_config.json``, from
the model the run started from (``init.hf_checkpoint``), else the ids of its tokenizer.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import shutil
import types
from typing import Any, NamedTuple

from jaxzero.data import chat
from jaxzero.data import tokens as tokens_lib
from jaxzero.errors import CheckpointError, DataError
from jaxzero.hf import config_json
from jaxzero.hf.load import CONFIG_FILE

log = logging.getLogger(__name__)

RUN_CONFIG = "config.json"  # the run's, in its workdir
GENERATION_CONFIG = "generation_config.json"
TEMPLATE_FILE = chat.TEMPLATE_FILES[0]  # chat_template.jinja: transformers 5 saves it apart
# The Hugging Face tokenizer files AutoTokenizer reads beside tokenizer.json; the template
# file wins over tokenizer_config.json's chat_template there, as in jaxzero.data.chat.
TOKENIZER_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json", TEMPLATE_FILE)
TEMPLATES_DIR = chat.TEMPLATES_DIR  # transformers' named templates, a .jinja each
_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


class Generation(NamedTuple):
  """config.json's carried fields (jaxzero.hf.config_json.CARRIED_FIELDS) and
  generation_config.json's contents (None: no such file)."""
  config: dict[str, Any]
  generation_config: dict[str, Any] | None


def read_run(workdir: str | os.PathLike) -> dict | None:
  """The run's config as WORKDIR/config.json records it; None where there is none (a run
  from before it was written, or a checkpoint jaxzero.Engine saved). One that cannot say
  data.tokenizer is a CheckpointError naming the file and why."""
  recorded = pathlib.Path(workdir) / RUN_CONFIG
  if not recorded.is_file():
    return None
  try:
    run = json.loads(recorded.read_text(encoding="utf-8"))
  except OSError as e:
    raise CheckpointError(f"{recorded} cannot be read: {e.strerror}") from None
  except json.JSONDecodeError as e:
    raise _damaged(recorded, f"not valid JSON at line {e.lineno} column {e.colno}") from None
  except ValueError:
    raise _damaged(recorded, "not UTF-8 text") from None
  data = run.get("data") if isinstance(run, dict) else None
  if not isinstance(data, dict) or not isinstance(data.get("tokenizer"), str):
    raise _damaged(recorded, "no data.tokenizer in it")
  return run


def _damaged(recorded: pathlib.Path, why: str) -> CheckpointError:
  return CheckpointError(f"{recorded} is damaged ({why}); export copies the tokenizer the run "
                         "records there: restore it, or move it aside to export without the "
                         "tokenizer files")


def generation_settings(run: dict | None, base: str = "") -> Generation:
  """From `base` (default: the run's init.hf_checkpoint), while it holds a config.json:
  its carried fields, and its generation_config.json or else one of its ids. Otherwise the
  special tokens' ids of the run's Hugging Face tokenizer, and max_position_embeddings as
  config_json derives it."""
  init = (run or {}).get("init")
  base = base or (init.get("hf_checkpoint", "") if isinstance(init, dict) else "")
  if base:
    directory = pathlib.Path(base).expanduser()
    found = _read_json(directory / CONFIG_FILE)
    if found is not None:
      carried = config_json.carried_fields(found)
      generation = _read_json(directory / GENERATION_CONFIG)
      generation = _ids_only(carried) if generation is None else generation
      # The document separator the run trained with (data.eos_token) ends a text too, and
      # so does the end of a turn a chat fine-tune learned to emit.
      ends = [_separator(run["data"]) if run and run["data"].get("eos_token") else None,
              _turn_end(run["data"]) if run else None]
      for end in ends:
        carried, generation = _with_end(carried, end), _with_end(generation, end)
      return Generation(carried, generation)
    log.warning("the run's init.hf_checkpoint=%s has no readable config.json now: the "
                "export's special-token ids and max_position_embeddings are not that model's",
                base)
  ids = _with_end(_tokenizer_ids(run["data"]), _turn_end(run["data"])) if run else {}
  return Generation(ids, _ids_only(ids))


# A conversation whose rendering shows how the chat template ends an assistant's turn.
_PROBE = {"messages": [{"role": "user", "content": "Hi"},
                       {"role": "assistant", "content": "Hello"}]}


def _turn_end(data: dict) -> int | None:
  """The token a chat fine-tune (data.format=chat) learned to end its turns with: the last
  special token of an assistant's message as its template renders it (Llama 3's
  <|eot_id|>, ChatML's <|im_end|>). None for other runs and byte-level ones, or where the
  template ends a turn with no special token."""
  if data.get("format") != "chat" or data["tokenizer"] == "byte":
    return None
  from tokenizers import Tokenizer  # pylint: disable=import-outside-toplevel
  try:
    template = chat.load_template(types.SimpleNamespace(
        tokenizer=data["tokenizer"], chat_template=data.get("chat_template", "")))
    text, spans, _ = chat.record_text(_PROBE, "chat", template)
    vocab = Tokenizer.from_file(str(_tokenizer_file(data["tokenizer"])))
  # A template or tokenizer the run read and that has changed since; the Rust side of
  # tokenizers raises its own exception type.
  except Exception as e:  # pylint: disable=broad-except
    log.warning("the end of a chat turn cannot be found (%s): the export's end tokens "
                "may not include it", e)
    return None
  special = {i for i, token in vocab.get_added_tokens_decoder().items() if token.special}
  start, end = spans[-1]
  found = [i for i in vocab.encode(text[start:end], add_special_tokens=False).ids
           if i in special]
  return found[-1] if found else None


def _separator(data: dict) -> int | None:
  try:
    return tokens_lib.load_tokenizer(data["tokenizer"], data.get("eos_token", "")).separator[0]
  except DataError as e:
    log.warning("%s: the export's end tokens are the base model's only", e)
    return None


def _with_end(fields: dict[str, Any] | None, end: int | None) -> dict[str, Any] | None:
  """`fields` with `end` among its eos_token_id (a list where there are several)."""
  if fields is None or end is None:
    return fields
  eos = fields.get("eos_token_id")
  ends = list(eos) if isinstance(eos, list) else [] if eos is None else [eos]
  if end in ends:
    return fields
  return {**fields, "eos_token_id": [*ends, end] if ends else end}


def _ids_only(fields: dict[str, Any]) -> dict[str, Any] | None:
  """generation_config.json for a model whose config.json has `fields`, as transformers
  derives it (None without ids)."""
  ids = {k: fields[k] for k in _ID_FIELDS if k in fields}
  return ids or None


def _read_json(path: pathlib.Path) -> dict | None:
  if not path.is_file():
    return None
  try:
    found = json.loads(path.read_text(encoding="utf-8"))
  except (OSError, ValueError) as e:
    log.warning("%s cannot be read (%s): not carried into the export", path, e)
    return None
  return found if isinstance(found, dict) else None


def _tokenizer_ids(data: dict) -> dict[str, Any]:
  """bos/eos/pad ids of a run's Hugging Face tokenizer: the tokens its tokenizer_config.json
  names, with the document separator the run used (jaxzero.data.tokens) as an end token
  too; for the byte-level tokenizer, its separator and no start or padding token (else
  transformers' defaults, 1 and 2, would stand); none for a tokenizer that is gone."""
  name = data["tokenizer"]
  if name == "byte":
    return {"bos_token_id": None, "eos_token_id": tokens_lib.BYTE_SEPARATOR,
            "pad_token_id": None}
  try:
    separator = tokens_lib.load_tokenizer(name, data.get("eos_token", "")).separator[0]
  except DataError as e:
    log.warning("%s: the export's config.json has no special-token ids", e)
    return {}
  from tokenizers import Tokenizer  # pylint: disable=import-outside-toplevel
  source = _tokenizer_file(name)
  vocab = Tokenizer.from_file(str(source))
  named = _read_json(source.parent / "tokenizer_config.json") or {}
  ids = {}
  for field in _ID_FIELDS:
    token = tokens_lib.named_token(named, field[:-len("_id")])
    token_id = vocab.token_to_id(token) if token else None
    if token_id is not None:
      ids[field] = token_id
  if ids.get("eos_token_id", separator) != separator:
    ids["eos_token_id"] = [ids["eos_token_id"], separator]
  else:
    ids["eos_token_id"] = separator
  return ids


def _tokenizer_file(name: str) -> pathlib.Path:
  path = pathlib.Path(name).expanduser()
  return path / "tokenizer.json" if path.is_dir() else path


def copy_tokenizer(run: dict | None, out: pathlib.Path) -> list[str]:
  """Copies the run's Hugging Face tokenizer into `out` with the chat template it trained
  with (data.chat_template where set, else the tokenizer's own), so that
  AutoTokenizer.from_pretrained(out) has both; returns the files written. A byte-level run
  has none (token id = byte value); nor has a workdir without config.json."""
  if run is None:
    log.warning("the workdir has no %s (a run from before it was written): the tokenizer is "
                "not exported", RUN_CONFIG)
    return []
  data = run["data"]
  name = data["tokenizer"]
  if name == "byte":
    log.info("the run used the byte-level tokenizer (token id = byte value): no tokenizer files")
    return []
  source = _tokenizer_file(name)
  if not source.is_file():
    log.warning("the run's data.tokenizer=%s no longer exists: the tokenizer is not exported",
                name)
    return []
  out = pathlib.Path(out)
  shutil.copyfile(source, out / "tokenizer.json")
  copied = ["tokenizer.json"]
  for side in TOKENIZER_SIDE_FILES:
    if (source.parent / side).is_file():
      shutil.copyfile(source.parent / side, out / side)
      copied.append(side)
  if (source.parent / TEMPLATES_DIR).is_dir():
    shutil.copytree(source.parent / TEMPLATES_DIR, out / TEMPLATES_DIR)
    copied.append(TEMPLATES_DIR)
  if "tokenizer_config.json" not in copied:
    # AutoTokenizer needs a class; the fast tokenizer reads tokenizer.json as is.
    (out / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}, indent=2) + "\n")
    copied.append("tokenizer_config.json")
  if data.get("chat_template") and _write_template(data, out) and TEMPLATE_FILE not in copied:
    copied.append(TEMPLATE_FILE)
  return copied


def _write_template(data: dict, out: pathlib.Path) -> bool:
  """Writes the run's data.chat_template as `out`'s chat_template.jinja, where it can
  still be read."""
  try:
    template = chat.load_template(types.SimpleNamespace(
        tokenizer=data["tokenizer"], chat_template=data["chat_template"]))
  except DataError as e:
    log.warning("%s: the export carries data.tokenizer's own chat template, not the run's", e)
    return False
  (out / TEMPLATE_FILE).write_text(template.text, encoding="utf-8")
  return True
