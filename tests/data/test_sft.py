"""Fine-tuning data: records rendered as transformers renders them, targets where TRL puts
them (assistant-only, completion-only), rows packed without changing any example's loss,
bad records counted rather than fatal, and a fine-tuning run equal on 1 and 8 devices."""

import dataclasses
import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxzero import config
from jaxzero.config.sections import DataConfig
from jaxzero.data import batches as batches_lib
from jaxzero.data import chat, sft
from jaxzero.models import trainable
from jaxzero.models.interface import Hooks
from jaxzero.models.llama import LlamaConfig

# A ChatML-like template; {% generation %} marks what transformers' assistant mask covers
# (the message and its end token, not the newline after it).
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>\n' }}"
            "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|end|>' }}"
            "{% endgeneration %}{{ '\n' }}{% else %}{{ m['content'] + '<|end|>\n' }}{% endif %}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}")
SPECIALS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHATS = [
    [{"role": "user", "content": "what is two and three"},
     {"role": "assistant", "content": "five"}],
    [{"role": "system", "content": "answer briefly"},
     {"role": "user", "content": "and three and three"},
     {"role": "assistant", "content": "six it is"},
     {"role": "user", "content": "again"},
     {"role": "assistant", "content": "six"}],
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
  """A byte-level BPE tokenizer with chat special tokens, saved as transformers saves one."""
  tokenizers = pytest.importorskip("tokenizers")
  transformers = pytest.importorskip("transformers")
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  text = [m["content"] for c in CHATS for m in c] * 20
  tok.train_from_iterator(text, tokenizers.trainers.BpeTrainer(
      vocab_size=300, special_tokens=SPECIALS,
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
  hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>",
                                            eos_token="</s>", unk_token="<unk>")
  hf.chat_template = TEMPLATE
  path = tmp_path_factory.mktemp("chat_tokenizer")
  hf.save_pretrained(path)
  return path


def write_jsonl(path, records):
  path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
  return path


def test_chat_targets_are_transformers_assistant_tokens(tokenizer_dir, tmp_path):
  from transformers import AutoTokenizer
  hf = AutoTokenizer.from_pretrained(tokenizer_dir)
  source = write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in CHATS])
  examples = sft.open_examples(DataConfig(source=str(source), format="chat",
                                          tokenizer=str(tokenizer_dir)), tmp_path, progress=False)
  assert len(examples) == len(CHATS) and not examples.skipped
  for i, messages in enumerate(CHATS):
    want = hf.apply_chat_template(messages, tokenize=True, return_dict=True,
                                  return_assistant_tokens_mask=True)
    start, stop = examples.starts[i], examples.starts[i + 1]
    np.testing.assert_array_equal(examples.tokens[start:stop], want["input_ids"])
    np.testing.assert_array_equal(examples.mask[start:stop], want["assistant_masks"])
  # The rendering itself is transformers' (the generation prompt included).
  template = chat.load_template(DataConfig(tokenizer=str(tokenizer_dir)))
  assert template.render(CHATS[1][:2], True)[0] == hf.apply_chat_template(
      CHATS[1][:2], tokenize=False, add_generation_prompt=True)


def test_prompt_completion_targets_are_the_completion_then_end_of_text(tmp_path):
  source = write_jsonl(tmp_path / "pc.jsonl", [
      {"prompt": "2+3=", "completion": " 5"},
      {"prompt": [{"role": "user", "content": "hi"}],
       "completion": [{"role": "assistant", "content": "yo"}]},
      {"prompt": "1+1=", "completion": " 2"}])  # kept in file order, whatever its kind
  examples = sft.open_examples(DataConfig(source=str(source), format="prompt_completion",
                                          chat_template=str(write_template(tmp_path))),
                               tmp_path, progress=False)
  plain = bytes(np.asarray(examples.tokens[:examples.starts[1]]))
  assert plain == b"2+3= 5\0"
  np.testing.assert_array_equal(examples.mask[:examples.starts[1]], [0, 0, 0, 0, 1, 1, 1])
  chat_tokens = bytes(np.asarray(examples.tokens[examples.starts[1]:examples.starts[2]]))
  chat_mask = np.asarray(examples.mask[examples.starts[1]:examples.starts[2]], bool)
  assert bytes(np.asarray(examples.tokens[examples.starts[2]:])) == b"1+1= 2\0"
  assert chat_tokens == b"<|user|>\nhi<|end|>\n<|assistant|>\nyo<|end|>\n"
  assert bytes(np.frombuffer(chat_tokens, np.uint8)[chat_mask]) == b"yo<|end|>\n"


def write_template(tmp_path, text=None):
  """TEMPLATE without its BOS and its generation marks: assistant text is then found by
  rendering prefixes (and takes the newline after the end token too)."""
  path = tmp_path / "template.jinja"
  path.write_text(text or TEMPLATE.replace("{{ bos_token }}", "").replace(
      "{% generation %}", "").replace("{% endgeneration %}", ""))
  return path


def test_a_line_nested_past_pythons_limit_is_a_record_not_valid_json(tmp_path):
  source = write_jsonl(tmp_path / "chat.jsonl", [
      '{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}", {"messages": CHATS[0]}])
  examples = sft.open_examples(DataConfig(source=str(source), format="chat",
                                          chat_template=str(write_template(tmp_path))),
                               tmp_path, progress=False)
  assert len(examples) == 1
  assert examples.skipped == {"not valid JSON (RecursionError)": {"count": 1,
                                                                  "first": "chat.jsonl:1"}}


def test_bad_records_are_counted_with_their_first_place(tmp_path):
  good = {"messages": CHATS[0]}
  source = write_jsonl(tmp_path / "chat.jsonl", [
      good, "{not json", {"messages": [{"role": "bot", "content": "x"}]}, good,
      {"messages": [{"role": "user", "content": "no answer"}]}, {"text": "x"},
      {"messages": [{"role": "user", "content": 3}]}, good])
  examples = sft.open_examples(DataConfig(source=str(source), format="chat",
                                          chat_template=str(write_template(tmp_path))),
                               tmp_path, progress=False)
  assert len(examples) == 3
  assert {k: (v["count"], v["first"]) for k, v in examples.skipped.items()} == {
      "not valid JSON (JSONDecodeError)": (1, "chat.jsonl:2"),
      "unknown role 'bot' (roles: system, user, assistant, tool)": (1, "chat.jsonl:3"),
      "no assistant message": (1, "chat.jsonl:5"),
      "no 'messages' list": (1, "chat.jsonl:6"),
      "a message without string 'content' in 'messages'": (1, "chat.jsonl:7")}


def test_a_template_that_rewrites_earlier_turns_skips_the_record(tmp_path):
  # Earlier assistant turns rendered shorter (as templates that drop past reasoning do).
  rewrites = ("{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}"
              "[earlier]{% else %}{{ m['content'] }}{% endif %}{% endfor %}")
  source = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHATS[0]}, {"messages": CHATS[1]}])
  examples = sft.open_examples(
      DataConfig(source=str(source), format="chat",
                 chat_template=str(write_template(tmp_path, rewrites))), tmp_path, progress=False)
  assert len(examples) == 1 and [v["first"] for v in examples.skipped.values()] == [
      "chat.jsonl:2"]
  assert "renders a conversation's beginning differently" in next(iter(examples.skipped))


def synthetic(lengths) -> sft.Examples:
  """Examples of the given lengths, token values distinct per example, targets from
  their third token on."""
  tokens = np.concatenate([(np.arange(n) * 7 + 31 * i) % 250 + 1 for i, n in enumerate(lengths)])
  mask = np.concatenate([np.arange(n) >= 2 for n in lengths]).astype(np.uint8)
  return sft.Examples(tokens.astype(np.uint8), mask, np.cumsum([0, *lengths]), 256, {})


def test_overlong_examples_are_truncated_or_dropped_and_counted():
  examples = synthetic([5, 20, 9, 3])
  late = dataclasses.replace(examples, mask=examples.mask.copy())
  late.mask[5:5 + 12] = 0  # example 1's targets begin at its 13th token
  truncated = sft.ExampleBatches(late, 9, 1, 2, 0, packing=False, overlong="truncate")
  assert truncated.truncated == 0  # cut to 10 tokens, it has no target left: dropped instead
  assert truncated.dropped == {"no target within train.seq_len+1": 1}
  assert truncated.n_rows == 3
  dropped = sft.ExampleBatches(examples, 9, 1, 2, 0, packing=False, overlong="drop")
  assert dropped.dropped == {"longer than train.seq_len+1": 1} and dropped.n_rows == 3
  kept = sft.ExampleBatches(examples, 9, 1, 2, 0, packing=False, overlong="truncate")
  assert kept.n_rows == 4 and kept.truncated == 1


def test_packing_fills_rows_with_whole_examples_each_visited_once_an_epoch():
  lengths = [9, 4, 3, 6, 3, 8, 5, 7, 3, 4]
  batches = sft.ExampleBatches(synthetic(lengths), 9, 2, 3, seed=4, packing=True)
  assert sorted(i for row in batches.rows for i in row) == list(range(len(lengths)))
  assert all(sum(lengths[i] for i in row) <= 10 for row in batches.rows)
  assert batches.n_rows == 6  # 52 tokens in rows of 10: best-fit decreasing needs 6
  seen = []
  for step in range(batches.n_rows // 6 + 1):  # 6 rows a step
    batch = batches(step)
    assert set(batch) == {"tokens", "loss_mask", "segment_ids"}
    seen += [tuple(row[row > 0]) for row in batch["tokens"].reshape(-1, 10)]
  assert len(set(seen[:batches.n_rows])) == batches.n_rows  # the first epoch: each row once
  # Process-local rows are the same rows, and a new instance (a resumed run) agrees.
  again = sft.ExampleBatches(synthetic(lengths), 9, 2, 3, seed=4, packing=True)
  np.testing.assert_array_equal(again(1, slice(1, 3))["segment_ids"],
                                batches(1)["segment_ids"][:, 1:3])


def test_held_out_rows_keep_the_examples_order_packed_or_not():
  """Evaluation reads the first rows: packed, they hold the first examples (packing
  alone would put the longest first), as they do one example a row."""
  lengths = [3, 9, 4, 8, 3, 6]
  packed = sft.ExampleBatches(synthetic(lengths), 9, 1, 2, 0, packing=True, order="fixed")
  firsts = [row[0] for row in packed.rows]
  assert firsts == sorted(firsts) and firsts[0] == 0
  assert sorted(i for row in packed.rows for i in row) == list(range(len(lengths)))


def test_a_tokenizer_larger_than_the_model_is_refused_before_any_tokenizing(tmp_path):
  from jaxzero.errors import DataError
  data = DataConfig(source=str(write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHATS[0]}])),
                    format="chat", chat_template=str(write_template(tmp_path)),
                    cache_dir=str(tmp_path / "cache"))
  with pytest.raises(DataError, match="has 256 tokens but model.vocab_size=100; the model's"):
    sft.open_examples(data, tmp_path, model_vocab_size=100, progress=False)
  assert not (tmp_path / "cache").exists()


CFG = LlamaConfig(vocab_size=256, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, mlp_dim=64,
                  rope_theta=10_000.0)


def test_each_example_has_the_same_loss_packed_as_alone():
  lengths = [7, 12, 5, 9, 3]
  examples = synthetic(lengths)
  packed = sft.ExampleBatches(examples, 23, 1, 3, 0, packing=True, order="fixed")(0)
  alone = sft.ExampleBatches(examples, 23, 1, 5, 0, packing=False, order="fixed")(0)
  model = trainable.llama(CFG)
  params = model.init(jax.random.key(0))

  def example_loss(batch, example):
    """The loss of `example`'s targets only, wherever its row holds it."""
    tokens = batch["tokens"][0]
    part = (np.arange(lengths[example]) * 7 + 31 * example) % 250 + 1
    row, start = next((r, i) for r in range(tokens.shape[0])
                      for i in range(tokens.shape[1] - part.size + 1)
                      if np.array_equal(tokens[r, i:i + part.size], part))
    only = np.zeros_like(tokens)
    only[row, start:start + part.size] = 1
    one = {k: v[0] for k, v in batch.items()}
    one["loss_mask"] = one["loss_mask"] * only
    return model.loss(params, jax.tree.map(jnp.asarray, one), Hooks())

  for example in range(len(lengths)):
    np.testing.assert_allclose(example_loss(packed, example), example_loss(alone, example),
                               rtol=1e-5)


def test_global_batch_places_every_field(tmp_path):
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  batches = sft.ExampleBatches(synthetic([5, 6, 7, 8, 9, 4, 3, 2]), 9, 2, 4, 0, packing=True)
  sharding = NamedSharding(Mesh(np.array(jax.devices()[:4]), ("data",)), P(None, "data"))
  placed = batches_lib.global_batch(batches, sharding, 3)
  chex.assert_trees_all_equal(jax.device_get(placed), batches(3))
  assert all(a.sharding == sharding for a in placed.values())


def sft_config(tmp_path, *overrides):
  source = write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in CHATS * 12])
  cfg = config.base()
  data = dataclasses.replace(cfg.data, source=str(source), format="chat", packing=True,
                             chat_template=str(write_template(tmp_path)),
                             cache_dir=str(tmp_path / "cache"), eval_fraction=0.25)
  return config.apply_overrides(dataclasses.replace(cfg, data=data), [
      "model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
      "model.mlp_dim=64", "train.seq_len=64", "train.global_batch=8", "train.grad_accum=1",
      "precision.compute=float32", "checkpoint.at_end=false",  # runs compare losses only
      "train.steps=2", "eval.every=2", "eval.batches=1", *overrides])


@pytest.fixture(scope="module")
def one_device_sft(tmp_path_factory):
  from jaxzero.training import loop
  tmp_path = tmp_path_factory.mktemp("sft_one")
  return loop.train(sft_config(tmp_path, "mesh.fsdp=1"), tmp_path / "one",
                    devices=jax.devices()[:1], progress=False)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [["zero.stage=3"], ["mesh.fsdp=4", "mesh.context=2"]])
def test_a_packed_chat_run_on_8_devices_equals_one_device(mesh, one_device_sft, tmp_path):
  # (mesh.context: segment ids cross the devices that split each row.)
  from jaxzero.training import loop
  eight = loop.train(sft_config(tmp_path, *mesh), tmp_path / "eight",
                     devices=jax.devices()[:8], progress=False)
  for a, b in zip(one_device_sft, eight):
    for key in ("loss", "eval_loss"):
      if key in a:
        np.testing.assert_allclose(a[key], b[key], rtol=1e-5)
  assert "eval_loss" in one_device_sft[-1]


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [
    ["mesh.fsdp=4", "mesh.pipeline=2"],
    ["mesh.fsdp=4", "mesh.pipeline=2", "pipeline.schedule=interleaved",
     "pipeline.virtual_stages=2", "model.n_layers=4"],
    ["mesh.fsdp=2", "offload.optimizer=nvme", "offload.params=nvme"]],
    ids=["gpipe", "interleaved", "zero_infinity"])
def test_a_packed_chat_run_pipelined_or_layer_by_layer_equals_one_device(mesh, tmp_path):
  """A packed row's segment ids and positions travel with it through the layers: across
  pipeline stages, and through ZeRO-Infinity's one program per layer."""
  from jaxzero.training import loop
  (tmp_path / "nvme").mkdir()
  common = ("train.grad_accum=2", "eval.every=0", "train.warmup_steps=0", "train.lr=1e-2",
            "train.steps=3", f"offload.nvme_dir={tmp_path / 'nvme'}")
  layers = [o for o in mesh if o.startswith("model.n_layers")]
  one = loop.train(sft_config(tmp_path, "mesh.fsdp=1", *common, *layers), tmp_path / "one",
                   devices=jax.devices()[:1], progress=False)
  n = 8 if "mesh.pipeline=2" in mesh else 2
  got = loop.train(sft_config(tmp_path, *mesh, *common), tmp_path / "got",
                   devices=jax.devices()[:n], progress=False)
  losses = [m["loss"] for m in one]
  assert abs(losses[-1] - losses[0]) > 1e-2  # the steps train
  np.testing.assert_allclose([m["loss"] for m in got], losses, rtol=1e-5)


@pytest.mark.parametrize("setting, message", [
    ({"chat_template": ""}, "data.format='chat' needs a chat template: data.tokenizer='byte' "
                            "has none beside it; set data.chat_template"),
    ({"chat_template": "/no/template.jinja"}, "data.chat_template='/no/template.jinja': no such "
                                              "file"),
    ({"rows": ["{bad", {"messages": []}]}, "holds no usable chat example (not valid JSON "
                                           "(JSONDecodeError) (1, first at chat.jsonl:1);"),
    ({"suffix": ".txt"}, "data.format='chat' reads records from .jsonl or .parquet files"),
    ({"template": "{{ bos_token }}{{ messages[0]['content'] }}"},
     "uses bos_token but no tokenizer_config.json beside it or data.tokenizer names one"),
    ({"template": "{% for m in messages %}"}, "the chat template is not valid Jinja"),
])
def test_bad_fine_tuning_data_is_one_line(setting, message, tmp_path):
  from jaxzero.errors import DataError
  rows = setting.get("rows", [{"messages": CHATS[0]}])
  source = write_jsonl(tmp_path / f"chat{setting.get('suffix', '.jsonl')}", rows)
  template = str(write_template(tmp_path, setting.get("template")))
  data = DataConfig(source=str(source), format="chat",
                    chat_template=setting.get("chat_template", template))
  with pytest.raises(DataError) as error:
    sft.open_examples(data, tmp_path, progress=False)
  assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("overrides, message", [
    (["data.packing=true"], "data.packing packs fine-tuning examples"),
    (["data.format=chat", "data.source=x.jsonl", "data.overlong=wrap"],
     "data.overlong='wrap'; choose 'truncate' or 'drop'"),
    (["data.format=chat", "data.source=x.jsonl", "data.packing=true", "mesh.pipeline=2",
      "train.grad_accum=4", "pipeline.schedule=1f1b"],
     "data.packing with pipeline.schedule=1f1b is not supported yet"),
    (["data.format=chat", "data.source=x.jsonl", "model_factory=m:f"],
     "model_factory's loss takes token windows"),
    (["data.format=chat", "data.source=x.jsonl", "data.text_field=conversations"],
     "data.text_field='conversations' with data.format='chat': it names the text of "
     "data.format='text' records; chat records hold 'messages'; leave it unset"),
])
def test_fine_tuning_settings_that_do_not_go_together_are_one_line(overrides, message):
  with pytest.raises(config.ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
    config.validate(config.apply_overrides(config.base(), overrides))


def test_a_token_across_the_start_of_a_reply_is_a_target_as_in_transformers(tokenizer_dir,
                                                                            tmp_path):
  """With a space before the reply (`<|assistant|> three`), byte-level BPE makes one token
  of " three": transformers' assistant mask takes every token with a character in the
  reply, so that token is learned."""
  from transformers import AutoTokenizer
  hf = AutoTokenizer.from_pretrained(tokenizer_dir)
  spaced = TEMPLATE.replace("'|>\n'", "'|> '")
  assert spaced != TEMPLATE
  messages = [{"role": "user", "content": "what is two and three"},
              {"role": "assistant", "content": "three"}]
  want = hf.apply_chat_template(messages, chat_template=spaced, tokenize=True, return_dict=True,
                                return_assistant_tokens_mask=True)
  assert "Ġthree" in hf.convert_ids_to_tokens(want["input_ids"])  # the token across the start
  template = tmp_path / "spaced.jinja"
  template.write_text(spaced)
  source = write_jsonl(tmp_path / "chat.jsonl", [{"messages": messages}])
  examples = sft.open_examples(DataConfig(source=str(source), format="chat",
                                          tokenizer=str(tokenizer_dir),
                                          chat_template=str(template)), tmp_path, progress=False)
  np.testing.assert_array_equal(examples.tokens[:], want["input_ids"])
  np.testing.assert_array_equal(examples.mask[:], want["assistant_masks"])


def test_message_keys_valued_none_are_left_out_as_transformers_does(tmp_path):
  """A Parquet column gives every message every key (`tool_calls: None`); transformers drops
  such keys before the template sees them, so a template testing `'tool_calls' in m`
  renders the message as it has none."""
  asks_tools = write_template(tmp_path).read_text().replace(
      "{% for m in messages %}",
      "{% for m in messages %}{% if 'tool_calls' in m %}{{ m['tool_calls'] | length }}{% endif %}")
  chats = [[{**m, "tool_calls": None} for m in c] for c in CHATS]
  source = write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in chats])
  examples = sft.open_examples(
      DataConfig(source=str(source), format="chat",
                 chat_template=str(write_template(tmp_path, asks_tools))), tmp_path,
      progress=False)
  assert len(examples) == len(CHATS) and not examples.skipped


def test_a_lone_surrogate_is_one_line_in_text_and_a_skipped_record_in_chat(tmp_path):
  from jaxzero.data import tokens as tokens_lib
  from jaxzero.errors import DataError
  half_emoji = '"bad \\ud83d half emoji"'
  text = tmp_path / "text.jsonl"
  text.write_text('{"text": "fine"}\n{"text": ' + half_emoji + '}\n')
  with pytest.raises(DataError, match=r"text.jsonl:2: field 'text' holds a lone UTF-16 surrogate"):
    tokens_lib.open_tokens(DataConfig(source=str(text)), tmp_path, progress=False)
  chat_file = tmp_path / "chat.jsonl"
  chat_file.write_text(json.dumps({"messages": CHATS[0]}) + "\n" + '{"messages": [{"role": '
                       '"user", "content": ' + half_emoji + '}, {"role": "assistant", '
                       '"content": "x"}]}\n')
  examples = sft.open_examples(DataConfig(source=str(chat_file), format="chat",
                                          chat_template=str(write_template(tmp_path))),
                               tmp_path, progress=False)
  assert len(examples) == 1 and examples.skipped == {
      "a lone UTF-16 surrogate (half of a character)": {"count": 1, "first": "chat.jsonl:2"}}


def test_a_failed_tokenization_leaves_no_partial_file(tmp_path):
  from jaxzero.data import tokens as tokens_lib
  from jaxzero.errors import DataError
  source = write_jsonl(tmp_path / "text.jsonl", [{"text": f"line {i}"} for i in range(3000)]
                       + ["{not json"])
  for _ in range(2):
    with pytest.raises(DataError, match="text.jsonl:3001: not valid JSON"):
      tokens_lib.open_tokens(DataConfig(source=str(source), cache_dir=str(tmp_path / "cache")),
                             None, progress=False)
  assert not list((tmp_path / "cache").rglob("*.tmp"))
  chat_source = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [
      {"role": "user", "content": "no answer"}]}])
  with pytest.raises(DataError, match="holds no usable chat example"):
    sft.open_examples(DataConfig(source=str(chat_source), format="chat",
                                 chat_template=str(write_template(tmp_path)),
                                 cache_dir=str(tmp_path / "cache")), None, progress=False)
  assert not list((tmp_path / "cache").rglob("*.tmp"))


def test_a_killed_tokenization_s_partial_file_is_removed_by_the_next_build(tmp_path):
  """A SIGKILL (or Ctrl-C's immediate exit at start-up) runs no clean-up; the next build of
  that cache deletes what it left, before writing its own."""
  from jaxzero.data import tokens as tokens_lib
  source = write_jsonl(tmp_path / "text.jsonl", [{"text": f"line {i}"} for i in range(30)])
  data = DataConfig(source=str(source), cache_dir=str(tmp_path / "cache"))
  tokens_lib.open_tokens(data, None, progress=False)
  (cache,) = [d for d in (tmp_path / "cache").iterdir() if d.is_dir()]
  (cache / "index.json").unlink()  # as if the build had been killed before its end
  (cache / "tokens.bin.12345.tmp").write_bytes(b"\0" * 1000)
  (cache / "mask.bin.tmp").write_bytes(b"\0" * 1000)
  tokens_lib.open_tokens(data, None, progress=False)
  assert not list(cache.glob("*.tmp")) and (cache / "index.json").exists()


def test_a_prompt_and_completion_of_different_kinds_is_skipped_naming_both(tmp_path):
  source = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "2+3=", "completion": " 5"},
                                               {"prompt": "2+2=", "completion": 4}])
  examples = sft.open_examples(DataConfig(source=str(source), format="prompt_completion"),
                               tmp_path, progress=False)
  assert len(examples) == 1 and list(examples.skipped) == [
      "'prompt' and 'completion' are not both strings or both lists of messages"]


def test_held_out_examples_that_fit_nowhere_are_named_as_held_out(tmp_path):
  from jaxzero.data import pipeline
  from jaxzero.errors import DataError
  long_chat = [{"role": "user", "content": "and three " * 20},
               {"role": "assistant", "content": "six " * 20}]
  held_out = write_jsonl(tmp_path / "long.jsonl", [{"messages": long_chat}] * 4)
  cfg = sft_config(tmp_path, f"data.eval_source={held_out}", "data.eval_fraction=0.0",
                   "data.overlong=drop")
  with pytest.raises(DataError, match=r"^the held-out examples \(data.eval_source='.*long.jsonl'\)"
                                      r": no example fits train.seq_len=64"):
    pipeline.open_data(cfg, tmp_path, 8, progress=False)


def test_the_banner_counts_the_examples_kept_and_says_what_the_held_out_split_leaves_out(
    tmp_path):
  from jaxzero.data import pipeline
  long_chat = [{"role": "user", "content": "and three " * 20},
               {"role": "assistant", "content": "six " * 20}]
  held_out = write_jsonl(tmp_path / "eval.jsonl", [{"messages": CHATS[0]}] * 3 + [
      {"messages": long_chat}, {"messages": [{"role": "human", "content": "hi"}]}])
  train = write_jsonl(tmp_path / "train.jsonl", [{"messages": CHATS[0]}] * 3 + [
      {"messages": long_chat}])
  cfg = sft_config(tmp_path, f"data.source={train}", f"data.eval_source={held_out}",
                   "data.eval_fraction=0.0", "data.overlong=drop")
  data = pipeline.open_data(cfg, tmp_path, 8, progress=False)
  assert ": 3 examples, " in data.description  # not 4: one is dropped
  assert data.held_out_left_out == (
      "1 unknown role 'human' (roles: system, user, assistant, tool) (first at eval.jsonl:5); "
      "1 longer than train.seq_len+1")


@pytest.mark.parametrize("trim_offsets", [False, True])
def test_a_plain_completions_token_across_the_boundary_is_the_prompts_as_in_trl(
    tokenizer_dir, tmp_path, trim_offsets):
  """Prompt "what is two and " and completion "three" tokenize as one " three": TRL counts
  the prompt's tokens, so that token is the prompt's; the end-of-text token is learned. A
  tokenizer that trims offsets (GPT-2's) starts the token after its space: it is the
  prompt's all the same."""
  import shutil
  from tokenizers import Tokenizer, processors
  from transformers import AutoTokenizer
  directory = shutil.copytree(tokenizer_dir, tmp_path / "tokenizer")
  tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
  tok.post_processor = processors.ByteLevel(trim_offsets=trim_offsets)
  tok.save(str(directory / "tokenizer.json"))
  hf = AutoTokenizer.from_pretrained(directory)
  source = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "what is two and ",
                                                 "completion": "three"}])
  examples = sft.open_examples(DataConfig(source=str(source), format="prompt_completion",
                                          tokenizer=str(directory)), tmp_path, progress=False)
  tokens = hf.convert_ids_to_tokens(np.asarray(examples.tokens[:]).tolist())
  assert tokens[-2:] == ["Ġthree", "</s>"]
  assert np.asarray(examples.mask[:]).tolist()[-2:] == [0, 1]


def test_a_records_tools_reach_the_template_and_a_tool_call_needs_no_content(tmp_path):
  """As TRL renders a record: its `tools` (a list, or that list as JSON text) and its
  chat_template_kwargs go to the template; an assistant's tool call with content None
  (OpenAI's shape) is rendered, not skipped."""
  tooled = ("{% if tools %}[tools: {{ tools | map(attribute='name') | join(',') }}]{% endif %}"
            "{% if think %}[think]{% endif %}{% for m in messages %}{{ m['role'] }}: "
            "{% if 'tool_calls' in m %}call {{ m['tool_calls'][0]['name'] }}{% else %}"
            "{{ m['content'] }}{% endif %};{% endfor %}")
  call = [{"role": "user", "content": "weather?"},
          {"role": "assistant", "content": None, "tool_calls": [{"name": "get_weather"}]},
          {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "sunny"}]
  template = chat.ChatTemplate("t", tooled, "", "")
  text, spans, _ = chat.record_text({"messages": call, "tools": '[{"name": "get_weather"}]',
                                     "chat_template_kwargs": {"think": True}}, "chat", template)
  assert text == ("[tools: get_weather][think]user: weather?;assistant: call get_weather;"
                  "tool: sunny;assistant: sunny;")
  assert [text[a:b] for a, b in spans] == ["assistant: call get_weather;", "assistant: sunny;"]
  with pytest.raises(chat.Skip, match="'tools' is text but not JSON"):
    chat.record_text({"messages": call, "tools": "[oops"}, "chat", template)


def test_a_chat_the_assistant_opens_trains_on_each_of_its_turns():
  """A support chat that opens with the assistant's greeting: a template that reads
  messages[0] (Llama-3.1's, Qwen2.5's) refused the empty conversation before it, and the
  record was left out as the template's fault."""
  opens = ("{% if messages[0]['role'] == 'system' %}[sys]{% endif %}{% for m in messages %}"
           "<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
           "{% if add_generation_prompt %}<|assistant|>{% endif %}")
  template = chat.ChatTemplate("t", opens, "", "")
  greeting = [{"role": "assistant", "content": "hello how can i help"},
              {"role": "user", "content": "the weather"},
              {"role": "assistant", "content": "sunny"}]
  text, spans, _ = chat.record_text({"messages": greeting}, "chat", template)
  assert [text[a:b] for a, b in spans] == ["hello how can i help<|end|>", "sunny<|end|>"]


def test_an_empty_tools_list_reaches_the_template_as_transformers_passes_it():
  template = chat.ChatTemplate("t", "{% if tools is not none %}[tools]{% endif %}"
                               "{% for m in messages %}{{ m['content'] }};{% endfor %}", "", "")
  text, _, _ = chat.record_text({"messages": CHATS[0], "tools": []}, "chat", template)
  assert text == "[tools]what is two and three;five;"


@pytest.mark.parametrize("legacy", [False, True])
def test_a_record_with_tools_is_rendered_by_the_tool_use_template(tokenizer_dir, tmp_path,
                                                                   legacy):
  """A tokenizer with named templates (Hermes 2 Pro's, Command R's) renders a record with
  tools by its "tool_use" one, as apply_chat_template does: saved by transformers 5 beside
  chat_template.jinja, or as a list in tokenizer_config.json. The default template left
  the tools out of the text."""
  from transformers import AutoTokenizer
  hf = AutoTokenizer.from_pretrained(tokenizer_dir)
  default = "{% for m in messages %}{{ m['content'] }};{% endfor %}"
  tool_use = "[tools: {{ tools | map(attribute='name') | join(',') }}]" + default
  hf.chat_template = {"default": default, "tool_use": tool_use}
  hf.save_pretrained(tmp_path / "tok")
  if legacy:  # the list form of transformers 4
    config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": default},
                               {"name": "tool_use", "template": tool_use}]
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(config))
    for p in [tmp_path / "tok" / "chat_template.jinja",
              *(tmp_path / "tok" / "additional_chat_templates").glob("*")]:
      p.unlink()
  template = chat.load_template(DataConfig(tokenizer=str(tmp_path / "tok"), format="chat"))
  tools = [{"name": "get_weather"}]
  for record_tools in (tools, None):
    text, _, _ = chat.record_text({"messages": CHATS[0], "tools": record_tools}, "chat",
                                  template)
    assert text == hf.apply_chat_template(CHATS[0], tools=record_tools, tokenize=False)
  assert text == "what is two and three;five;"


def test_a_jsonl_file_not_in_utf8_is_one_line_not_records_left_out(tmp_path):
  """A Latin-1 file lost its records with accents (each 'not valid JSON'), and a UTF-16
  one half-decoded; either is the file's error."""
  from jaxzero.errors import DataError
  accented = {"messages": [{"role": "user", "content": "café"},
                           {"role": "assistant", "content": "crème"}]}
  lines = "".join(json.dumps(r, ensure_ascii=False) + "\n"
                  for r in ({"messages": CHATS[0]}, {"messages": CHATS[0]}, accented))
  data = DataConfig(source=str(tmp_path / "chat.jsonl"), format="chat",
                    chat_template=str(write_template(tmp_path)))
  for encoding, where in (("latin-1", "line 3"), ("utf-16", "line 1")):
    (tmp_path / "chat.jsonl").write_bytes(lines.encode(encoding))
    with pytest.raises(DataError, match=rf"chat.jsonl: not UTF-8 text \(.* at byte [\d,]+, "
                                        rf"{where}\)"):
      sft.open_examples(data, tmp_path / encoding, progress=False)


def test_a_template_that_ends_the_conversation_with_its_eos_keeps_multi_turn_records():
  """Phi-3's templates end the whole conversation with the end-of-text token: an earlier
  turn's rendering ends with it, the whole does not there. The turn is its span without
  it, as in the whole; the last turn's span keeps it."""
  phi3 = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>{% else %}{{ eos_token }}{% endif %}")
  template = chat.ChatTemplate("phi3", phi3, "<s>", "<|endoftext|>")
  text, spans, _ = chat.record_text({"messages": CHATS[1]}, "chat", template)
  assert [text[a:b] for a, b in spans] == ["six it is<|end|>", "six<|end|><|endoftext|>"]


def _tokenizer_with(path, specials, eos):
  """A byte-level BPE tokenizer with `specials`, whose tokenizer_config.json names `eos`."""
  tokenizers = pytest.importorskip("tokenizers")
  transformers = pytest.importorskip("transformers")
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  tok.train_from_iterator(["five six"] * 10, tokenizers.trainers.BpeTrainer(
      vocab_size=280, special_tokens=specials,
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
  transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos).save_pretrained(path)
  return path


def test_fine_tuning_ends_a_completion_with_the_tokenizers_own_eos_and_chat_needs_none(
    tmp_path):
  """A completion ends with tokenizer_config.json's eos_token, as TRL appends
  tokenizer.eos_token (an Instruct tokenizer's <|eot_id|>, not <|end_of_text|>), once; a
  chat ends its turns by its template, so a tokenizer with no usual end-of-text token
  takes chat records."""
  instruct = _tokenizer_with(tmp_path / "instruct", ["<|end_of_text|>", "<|eot_id|>"],
                             "<|eot_id|>")
  source = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "five", "completion": " six"},
                                               {"prompt": "five", "completion": "six<|eot_id|>"}])
  examples = sft.open_examples(DataConfig(source=str(source), format="prompt_completion",
                                          tokenizer=str(instruct)), tmp_path, progress=False)
  ends = [int(examples.tokens[examples.starts[i + 1] - 1]) for i in range(2)]
  lasts = [int(examples.tokens[examples.starts[i + 1] - 2]) for i in range(2)]
  assert ends == [1, 1] and lasts[1] != 1  # <|eot_id|> (id 1: the specials come first), once
  odd = _tokenizer_with(tmp_path / "odd", ["<｜end▁of▁sentence｜>"], "<｜end▁of▁sentence｜>")
  (odd / "tokenizer_config.json").write_text("{}")  # and nothing names it
  chats = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHATS[0]}])
  examples = sft.open_examples(DataConfig(source=str(chats), format="chat", tokenizer=str(odd),
                                          chat_template=str(write_template(tmp_path))),
                               tmp_path, progress=False)
  assert len(examples) == 1


def test_a_directory_source_that_holds_a_test_split_is_warned_of(tmp_path, caplog):
  """A dataset snapshot (Hugging Face's data/train_sft-*.parquet beside test_sft-*): the
  directory reads both, and the test split would be trained on."""
  from jaxzero.data import pipeline
  snapshot = tmp_path / "snapshot"
  (snapshot / "data").mkdir(parents=True)
  for name in ("train_sft-00000.jsonl", "test_sft-00000.jsonl"):
    write_jsonl(snapshot / "data" / name, [{"messages": c} for c in CHATS * 12])
  cfg = sft_config(tmp_path, f"data.source={snapshot}")
  pipeline.open_data(cfg, tmp_path, 8, progress=False)
  assert ("reads 1 file(s) named as a held-out split (first data/test_sft-00000.jsonl): they "
          "are trained on") in caplog.text
  caplog.clear()
  pipeline.open_data(sft_config(tmp_path, f"data.source={snapshot}/**/train*"), tmp_path, 8,
                     progress=False)
  assert "held-out split" not in caplog.text
