"""Fine-tuning records as text: chat templates, and the spans the loss is taken on.

A record is one JSON line (or Parquet row): ``messages`` (``data.format=chat``) or
``prompt`` and ``completion`` (``data.format=prompt_completion``: two strings, or two
message lists rendered as one chat). It becomes one string and the character spans of
its targets: the assistant's messages, or the completion. Chat templates are the
tokenizer's own Jinja (``chat_template.jinja`` or ``tokenizer_config.json``), rendered
in a sandbox with transformers' filters and globals. Assistant spans are found by
rendering prefixes, as TRL does: the conversation up to message i with the generation
prompt must begin the whole rendering, and message i ends where ``messages[:i+1]``'s
rendering ends. A record that cannot be used raises :class:`Skip` (counted, not fatal).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import pathlib

from jaxzero.errors import DataError

FORMATS = ("chat", "prompt_completion")
ROLES = ("system", "user", "assistant", "tool")
TEMPLATE_FILES = ("chat_template.jinja", "tokenizer_config.json")


class Skip(Exception):
  """A record left out of training; its message is the reason (counted by kind)."""


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
  path: str
  text: str
  bos_token: str
  eos_token: str

  @property
  def digest(self) -> str:
    return hashlib.sha256(json.dumps([self.text, self.bos_token, self.eos_token]).encode()
                          ).hexdigest()

  def render(self, messages: list[dict], generation_prompt: bool = False) -> str:
    try:
      return _compile(self.text).render(messages=messages, bos_token=self.bos_token,
                                        eos_token=self.eos_token,
                                        add_generation_prompt=generation_prompt)
    except Exception as e:  # raise_exception() and a template's own errors
      raise Skip(f"the chat template refused it ({e})") from None


def load_template(data) -> ChatTemplate | None:
  """The chat template of data.chat_template (a .jinja file, a tokenizer_config.json or
  a directory holding one), else of data.tokenizer's directory; None if there is none."""
  if data.chat_template:
    where = pathlib.Path(data.chat_template).expanduser()
    candidates = [where / name for name in TEMPLATE_FILES] if where.is_dir() else [where]
    found = [p for p in candidates if p.is_file()]
    if not found:
      raise DataError(f"data.chat_template={data.chat_template!r}: no such file; give a "
                      ".jinja file, a tokenizer_config.json or a directory holding one")
    return _read_template(found[0], required=True)
  if data.tokenizer == "byte":
    return None
  folder = pathlib.Path(data.tokenizer).expanduser()
  folder = folder if folder.is_dir() else folder.parent
  for name in TEMPLATE_FILES:
    if (folder / name).is_file() and (template := _read_template(folder / name, False)):
      return template
  return None


def _read_template(path: pathlib.Path, required: bool) -> ChatTemplate | None:
  config = {}
  tokenizer_config = path.with_name("tokenizer_config.json")
  if tokenizer_config.is_file():
    try:
      config = json.loads(tokenizer_config.read_text())
    except (ValueError, UnicodeDecodeError) as e:
      raise DataError(f"{tokenizer_config}: not valid JSON ({e})") from None
  if path.suffix == ".json":
    text = config.get("chat_template")
    if isinstance(text, list):  # named templates: the default one
      text = next((t.get("template") for t in text if t.get("name") == "default"), None)
  else:
    text = path.read_text()
  if not isinstance(text, str) or not text:
    if required:
      raise DataError(f"data.chat_template={str(path)!r} holds no chat template")
    return None
  token = lambda key: (config.get(key) or {}).get("content", "") if isinstance(
      config.get(key), dict) else config.get(key) or ""
  return ChatTemplate(str(path.resolve()), text, token("bos_token"), token("eos_token"))


@functools.lru_cache(maxsize=8)
def _compile(text: str):
  import jinja2  # pylint: disable=import-outside-toplevel
  from jinja2 import ext, sandbox  # pylint: disable=import-outside-toplevel

  class Generation(ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (templates that mark assistant text for
    transformers' tracker) renders its body: spans come from prefix renderings here."""
    tags = {"generation"}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
      return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
      return caller()

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                              extensions=[Generation, ext.loopcontrols])
  env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, \
      sort_keys=False: json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                                  separators=separators, sort_keys=sort_keys)
  env.globals["raise_exception"] = raise_exception
  # No strftime_now: an example must not depend on the day it was tokenized, so
  # templates take their own fixed date (Llama 3.1's: 26 Jul 2024).
  try:
    return env.from_string(text)
  except jinja2.TemplateSyntaxError as e:
    raise DataError(f"the chat template is not valid Jinja (line {e.lineno}: {e.message})"
                    ) from None


def record_text(record, fmt: str, template: ChatTemplate | None
                ) -> tuple[str, list[tuple[int, int]], bool]:
  """(text, target spans [start, end) in characters, plain) of one record. `plain` text
  is tokenized with the tokenizer's start tokens and ends with its end-of-text token (a
  target); a rendered chat carries its own special tokens."""
  if not isinstance(record, dict):
    raise Skip(f"a {type(record).__name__}, not an object")
  if fmt == "chat":
    return _chat(_messages(record, "messages"), template)
  for key in ("prompt", "completion"):
    if key not in record:
      raise Skip(f"no {key!r} field")
  prompt, completion = record["prompt"], record["completion"]
  if isinstance(prompt, str) and isinstance(completion, str):
    if not completion:
      raise Skip("an empty completion")
    return prompt + completion, [(len(prompt), len(prompt) + len(completion))], True
  prompt, completion = _messages(record, "prompt"), _messages(record, "completion")
  template = _needs(template)
  start = template.render(prompt, generation_prompt=True)
  text = template.render(prompt + completion)
  if not text.startswith(start):
    raise DataError(f"the chat template ({template.path}) does not begin a chat's rendering "
                    "with its prompt's; the completion's tokens cannot be found")
  return text, [(len(start), len(text))], False


def _chat(messages: list[dict], template: ChatTemplate | None):
  template = _needs(template)
  text = template.render(messages)
  spans = []
  for i, message in enumerate(messages):
    if message["role"] != "assistant":
      continue
    start = template.render(messages[:i], generation_prompt=True)
    end = template.render(messages[:i + 1])
    if not (text.startswith(start) and text.startswith(end)):
      raise DataError(f"the chat template ({template.path}) does not render a conversation's "
                      "beginning as the beginning of the whole; the assistant's tokens cannot "
                      "be found")
    spans.append((len(start), len(end)))
  if not spans:
    raise Skip("no assistant message")
  return text, spans, False


def _messages(record: dict, key: str) -> list[dict]:
  messages = record.get(key)
  if not isinstance(messages, list) or not messages:
    raise Skip(f"no {key!r} list" if key not in record else f"{key!r} is not a list of messages")
  for message in messages:
    if not isinstance(message, dict) or not isinstance(message.get("content"), str):
      raise Skip(f"a message without string 'content' in {key!r}")
    if message.get("role") not in ROLES:
      raise Skip(f"unknown role {message.get('role')!r} (roles: {', '.join(ROLES)})")
  return messages


def _needs(template: ChatTemplate | None) -> ChatTemplate:
  if template is None:
    raise DataError("chat messages need a chat template: data.tokenizer's directory has none "
                    "(chat_template.jinja or tokenizer_config.json); set data.chat_template")
  return template
