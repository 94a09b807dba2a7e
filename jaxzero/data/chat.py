"""Fine-tuning records as text: chat templates, and the spans the loss is taken on.

A record is one JSON line (or Parquet row): ``messages`` (``data.format=chat``) or
``prompt`` and ``completion`` (``data.format=prompt_completion``: two strings, or two
message lists rendered as one chat). It becomes one string and the character spans of
its targets: the assistant's messages, or the completion. Chat templates are the
tokenizer's own Jinja (``chat_template.jinja`` or ``tokenizer_config.json``), rendered
in a sandbox with transformers' settings, filters and arguments. A template that marks
assistant text with ``{% generation %}`` gives the spans itself, as transformers'
``assistant_masks`` takes them. Otherwise they are found by rendering prefixes, as TRL
does: the conversation up to message i with the generation prompt must begin the whole
rendering, and message i ends where ``messages[:i+1]``'s rendering ends (less the
template's end-of-text token where it ends only the whole conversation, as Phi-3's); a
record for which it does not (a template that rewrites earlier turns) is skipped. A
record's ``tools`` and ``chat_template_kwargs`` go to the template as TRL passes them, and
an assistant's tool call may have no content. A record that cannot be used raises
:class:`Skip` (counted, not fatal).
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import hashlib
import json
import pathlib

from jaxzero.data import tokens as tokens_lib
from jaxzero.errors import DataError

ROLES = ("system", "user", "assistant", "tool")
TEMPLATE_FILES = ("chat_template.jinja", "tokenizer_config.json")
TEMPLATES_DIR = "additional_chat_templates"  # transformers 5's other named templates
# (rendered pieces so far, spans found) while a rendering tracks {% generation %} blocks.
_TRACKING: contextvars.ContextVar = contextvars.ContextVar("generation_spans", default=None)


class Skip(Exception):
  """A record left out of training; its message is the reason (counted by kind)."""


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
  path: str
  text: str
  bos_token: str
  eos_token: str
  # The tokenizer's "tool_use" template, which transformers renders a record with tools
  # by (Hermes 2 Pro's, Command R's); "" where it has none.
  tool_use: str = ""

  @property
  def digest(self) -> str:
    return hashlib.sha256(json.dumps([self.text, self.bos_token, self.eos_token,
                                      self.tool_use]).encode()).hexdigest()

  def chosen(self, tools) -> str:
    """The template a record is rendered by: tool_use where it has tools, as
    transformers' get_chat_template picks it."""
    return self.tool_use if tools is not None and self.tool_use else self.text

  def marks_generation(self, tools=None) -> bool:
    """Whether the template marks the assistant's text with {% generation %} blocks."""
    return "generation" in _compile(self.chosen(tools)).environment.extensions[_EXTENSION].seen

  def render(self, messages: list[dict], generation_prompt: bool = False, tools=None,
             **kwargs) -> tuple[str, list[tuple[int, int]]]:
    """(the text, the character spans of its {% generation %} blocks); `tools` and
    `kwargs` (a record's chat_template_kwargs) go to the template as transformers'
    apply_chat_template passes them."""
    pieces: list[str] = []
    spans: list[tuple[int, int]] = []
    token = _TRACKING.set((pieces, spans))
    try:
      for piece in _compile(self.chosen(tools)).generate(**{
          **kwargs, "messages": messages, "bos_token": self.bos_token,
          "eos_token": self.eos_token, "add_generation_prompt": generation_prompt,
          "tools": tools, "documents": None}):
        pieces.append(piece)
    except Exception as e:  # raise_exception() and a template's own errors
      raise Skip(f"the chat template refused it ({e})") from None
    finally:
      _TRACKING.reset(token)
    return "".join(pieces), spans


def load_template(data) -> ChatTemplate | None:
  """The chat template of data.chat_template (a .jinja file, a tokenizer_config.json or
  a directory holding one), else of data.tokenizer's directory; None if there is none.
  Its bos_token and eos_token come from the tokenizer_config.json beside it, else from
  data.tokenizer's."""
  tokenizer_dir = None
  if data.tokenizer != "byte":
    tokenizer_dir = pathlib.Path(data.tokenizer).expanduser()
    tokenizer_dir = tokenizer_dir if tokenizer_dir.is_dir() else tokenizer_dir.parent
  if data.chat_template:
    where = pathlib.Path(data.chat_template).expanduser()
    candidates = [where / name for name in TEMPLATE_FILES] if where.is_dir() else [where]
    found = [p for p in candidates if p.is_file()]
    if not found:
      raise DataError(f"data.chat_template={data.chat_template!r}: no such file; give a "
                      ".jinja file, a tokenizer_config.json or a directory holding one")
    template = _read_template(found[0], tokenizer_dir)
    if template is None:
      raise DataError(f"data.chat_template={data.chat_template!r} holds no chat template")
    return template
  for name in TEMPLATE_FILES if tokenizer_dir else ():
    if (tokenizer_dir / name).is_file() and (
        template := _read_template(tokenizer_dir / name, tokenizer_dir)):
      return template
  return None


def _read_json(path: pathlib.Path) -> dict:
  try:
    config = json.loads(path.read_text(encoding="utf-8"))
  except (ValueError, UnicodeDecodeError) as e:
    raise DataError(f"{path}: not valid JSON ({e})") from None
  if not isinstance(config, dict):
    raise DataError(f"{path}: not a JSON object")
  return config


def _read_template(path: pathlib.Path, tokenizer_dir: pathlib.Path | None) -> ChatTemplate | None:
  tool_use = ""
  if path.suffix == ".json":
    text = _read_json(path).get("chat_template")
    if isinstance(text, list):  # named templates: the default one, and the one for tools
      named = {t.get("name"): t.get("template") for t in text if isinstance(t, dict)}
      text, tool_use = named.get("default"), named.get("tool_use") or ""
  else:
    text = _read_text(path)
    if (path.parent / TEMPLATES_DIR / "tool_use.jinja").is_file():
      tool_use = _read_text(path.parent / TEMPLATES_DIR / "tool_use.jinja")
  if not isinstance(text, str) or not text:
    return None
  config = {}
  for folder in (path.parent, tokenizer_dir):
    if folder is not None and (folder / "tokenizer_config.json").is_file():
      config = _read_json(folder / "tokenizer_config.json")
      break
  template = ChatTemplate(str(path.resolve()), text, tokens_lib.named_token(config, "bos_token"),
                          tokens_lib.named_token(config, "eos_token"),
                          tool_use if isinstance(tool_use, str) else "")
  for named in filter(None, (text, template.tool_use)):
    _compile(named)  # a syntax error is one line now, not a skip per record
  for key in ("bos_token", "eos_token"):
    if key in text + template.tool_use and not getattr(template, key):
      raise DataError(f"the chat template ({path}) uses {key} but no tokenizer_config.json "
                      "beside it or data.tokenizer names one")
  return template


def _read_text(path: pathlib.Path) -> str:
  try:
    return path.read_text(encoding="utf-8")
  except UnicodeDecodeError as e:
    raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


_EXTENSION = "jaxzero.data.chat.Generation"


@functools.lru_cache(maxsize=8)
def _compile(text: str):
  import jinja2  # pylint: disable=import-outside-toplevel
  from jinja2 import ext, sandbox  # pylint: disable=import-outside-toplevel

  class Generation(ext.Extension):
    """``{% generation %}...{% endgeneration %}``: renders its body and, while a
    rendering tracks them, records the body's character span (transformers'
    AssistantTracker)."""
    tags = {"generation"}
    identifier = _EXTENSION

    def __init__(self, environment):
      super().__init__(environment)
      self.seen = set()

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      self.seen.add("generation")
      body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
      return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
      text = caller()
      if (tracking := _TRACKING.get()) is not None:
        pieces, spans = tracking
        start = len("".join(pieces))
        spans.append((start, start + len(text)))
      return text

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
    messages = _messages(record, "messages")
    if not any(m["role"] == "assistant" for m in messages):
      raise Skip("no assistant message")
    return (*_chat(messages, _needs(template), len(messages), **_extras(record)), False)
  for key in ("prompt", "completion"):
    if key not in record:
      raise Skip(f"no {key!r} field")
  prompt, completion = record["prompt"], record["completion"]
  if isinstance(prompt, str) != isinstance(completion, str):
    raise Skip("'prompt' and 'completion' are not both strings or both lists of messages")
  if isinstance(prompt, str):
    if not completion:
      raise Skip("an empty completion")
    return prompt + completion, [(len(prompt), len(prompt) + len(completion))], True
  prompt, completion = _messages(record, "prompt"), _messages(record, "completion")
  return (*_chat(prompt + completion, _needs(template), len(completion), **_extras(record)),
          False)


def _extras(record: dict) -> dict:
  """What a record gives the template besides its messages, as TRL passes it: its tools
  (a list of function schemas, or that list as JSON text) and chat_template_kwargs."""
  tools, kwargs = record.get("tools"), record.get("chat_template_kwargs") or {}
  if isinstance(tools, str):
    try:
      tools = json.loads(tools)
    except ValueError:
      raise Skip("'tools' is text but not JSON") from None
  if tools is not None and not isinstance(tools, list):
    raise Skip("'tools' is not a list of function schemas")
  if not isinstance(kwargs, dict):
    raise Skip("'chat_template_kwargs' is not an object")
  return {**kwargs, "tools": tools}


def _chat(messages: list[dict], template: ChatTemplate, last: int, **extras):
  """(text, spans) of a chat whose targets are the assistant's messages among the
  `last` ones."""
  text, marked = template.render(messages, **extras)
  first = len(messages) - last
  if template.marks_generation(extras.get("tools")):  # its own spans, of the last messages
    before = (len(template.render(messages[:first], generation_prompt=True, **extras)[0])
              if first else 0)
    spans = [span for span in marked if span[0] >= before]
  else:
    spans = []
    for i in range(first, len(messages)):
      if messages[i]["role"] != "assistant":
        continue
      end = template.render(messages[:i + 1], **extras)[0]
      if i:
        start = template.render(messages[:i], generation_prompt=True, **extras)[0]
      else:  # a chat the assistant opens has nothing before it to render: from its text on
        content = messages[0].get("content", "").strip()
        start = end[:end.rfind(content)] if content and content in end else None
      eos = template.eos_token
      if (not text.startswith(end) and eos and end.endswith(eos)
          and text.startswith(end[:-len(eos)])):
        # A template that ends the conversation with its end-of-text token (Phi-3's):
        # it ends this turn only where the turn is the last.
        end = end[:-len(eos)]
      if start is None:
        raise Skip("the chat template does not render an opening assistant message's text "
                   "as given, so its tokens cannot be found")
      if not (text.startswith(start) and text.startswith(end)):
        raise Skip("the chat template renders a conversation's beginning differently from "
                   "the whole, so its assistant tokens cannot be found")
      spans.append((len(start), len(end)))
  if not spans:
    raise Skip("no assistant message")
  return text, spans


def _messages(record: dict, key: str) -> list[dict]:
  """The record's messages, each without its keys valued None, as transformers'
  apply_chat_template hands them to a template (a Parquet column gives every message
  every key: `tool_calls: None` where a message has none)."""
  messages = record.get(key)
  if not isinstance(messages, list) or not messages:
    raise Skip(f"no {key!r} list" if key not in record else f"{key!r} is not a list of messages")
  messages = [{k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m
              for m in messages]
  for message in messages:
    # An assistant's tool call may have no content (OpenAI's content=None, dropped above).
    calls = isinstance(message, dict) and "content" not in message and isinstance(
        message.get("tool_calls"), list) and message.get("role") == "assistant"
    if not calls and (not isinstance(message, dict)
                      or not isinstance(message.get("content"), str)):
      raise Skip(f"a message without string 'content' in {key!r}")
    if message.get("role") not in ROLES:
      raise Skip(f"unknown role {message.get('role')!r} (roles: {', '.join(ROLES)})")
  return messages


def _needs(template: ChatTemplate | None) -> ChatTemplate:
  if template is None:
    raise DataError("chat messages need a chat template: data.tokenizer's directory has none "
                    "(chat_template.jinja or tokenizer_config.json); set data.chat_template")
  return template
