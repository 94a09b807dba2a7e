"""Config loading, dotted overrides and their errors."""

import dataclasses
import pathlib
import re

import pytest

from jaxzero import config
from jaxzero.config import ConfigError
from jaxzero.parallel import mesh

CONFIGS = pathlib.Path(__file__).resolve().parent.parent / "configs"


def test_override_parses_to_the_field_type():
  cfg = config.apply_overrides(config.base(), [
      "train.steps=7", "train.lr=0.5", "model.tie_embeddings=true", "zero.stage=2",
      "precision.compute=float32", "data.source=/tmp/x.txt"])
  assert cfg.train.steps == 7 and isinstance(cfg.train.steps, int)
  assert cfg.train.lr == 0.5
  assert cfg.model.tie_embeddings is True
  assert cfg.zero.stage == 2
  assert cfg.precision.compute == "float32"
  assert cfg.data.source == "/tmp/x.txt"


@pytest.mark.parametrize("assignment, expected", [
    ("train.stepz=3", "unknown config key 'train.stepz'; valid keys here: train.steps"),
    ("zero.stage=5", "zero.stage='5' is not valid; choose one of: 0, 1, 2, 3"),
    ("remat.policy=most", "choose one of: none, full, save_matmuls"),
    ("train.steps=many", "train.steps='many' is not a valid int"),
    ("train=3", "'train' is a section; set one of its keys: train.steps"),
    ("zero.strategy=FULL", "HYBRID_SHARD"),
    ("train.steps", "must look like KEY=VALUE"),
    ("zero.reduce_dtype=fp8", "zero.reduce_dtype='fp8' is not valid; choose one of: '', float32, "
     "bfloat16, float16"),
    ("model.attention=flash", "model.attention='flash' is not valid; choose one of: auto, xla, "
     "cudnn, blockwise"),
])
def test_bad_override_names_key_and_choices(assignment, expected):
  with pytest.raises(ConfigError, match=None) as info:
    config.apply_overrides(config.base(), [assignment])
  assert expected in str(info.value)
  assert "\n" not in str(info.value)


def test_llama3_rope_scaling_needs_its_frequency_band():
  """A low frequency factor of 0 divides by zero at compile; one at or above the high
  factor gives wrong frequencies without a sign."""
  with pytest.raises(ConfigError, match=r"model.rope_scaling_factor=8.0 \(Llama 3's rope "
                     r"scaling\) needs .* got 8192, 0.0 and 4.0$"):
    config.validate(config.apply_overrides(config.base(), [
        "model.rope_scaling_factor=8", "model.rope_low_freq_factor=0"]))


@pytest.mark.parametrize("assignments, expected", [
    (["offload.optimizer=pinned_host", "offload.optimizer_fraction=-0.1"],
     "offload.optimizer_fraction=-0.1 must be between 0 and 1"),
    (["offload.optimizer_fraction=0.5"], "offload.optimizer_fraction=0.5 applies to the "
     "optimizer in host memory: set offload.optimizer=pinned_host (got offload.optimizer=device)"),
    (["offload.optimizer=nvme", "offload.delayed_update=true"],
     "offload.delayed_update=True applies to the optimizer in host memory"),
    (["offload.optimizer=pinned_host", "offload.delayed_update=true",
      "precision.compute=float16"], "a step that overflows would skip an update already under way"),
    (["offload.optimizer=pinned_host", "offload.delayed_update=true",
      "offload.delayed_update_after=-1"],
     "offload.delayed_update_after=-1 must be a step count >= 0 (0: DPU from the first step)"),
])
def test_offload_settings_that_cannot_run_are_one_line(assignments, expected):
  with pytest.raises(ConfigError) as info:
    config.validate(config.apply_overrides(config.base(), assignments))
  assert expected in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("assignment, expected", [
    ("model.n_kv_heads=0", "model.n_kv_heads=0 must be at least 1"),
    ("model.n_heads=0", "model.n_heads=0 must be at least 1"),
    ("seed=-1", "seed=-1 must not be negative"),
    ("train.warmup_steps=-3", "train.warmup_steps=-3 must not be negative"),
    ("model.n_heads=3", "model.dim=128 must be divisible by model.n_heads=3"),
    ("precision.loss_scale=-1", "precision.loss_scale=-1.0 must be 0 (dynamic loss scaling) or "
     "a positive static scale"),
    ("precision.min_loss_scale=1e6", "precision.min_loss_scale=1e+06 must be positive and at "
     "most the initial scale 2**precision.initial_scale_power = 65536"),
    ("precision.loss_scale_window=0", "precision.loss_scale_window=0 and precision.hysteresis=2 "
     "must be at least 1"),
    ("model.dim=132", "model.dim=132 / model.n_heads=4 is a head dimension of 33; rotary "
     "embeddings need it even"),
    ("train.lr=nan", "train.lr=nan must be a finite number"),
    ("train.clip_norm=inf", "train.clip_norm=inf must be a finite number"),
    ("model.rope_theta=-inf", "model.rope_theta=-inf must be a finite number"),
    ("data.max_bytes=-5", "data.max_bytes=-5 must not be negative"),
    ("train.eps=-1", "train.eps=-1.0 must not be negative"),
    ("train.b1=1.5", "train.b1=1.5 must be in [0, 1)"),
    ("train.b2=1", "train.b2=1.0 must be in [0, 1)"),
    ("train.min_lr_ratio=5", "train.min_lr_ratio=5.0 must be at most 1 (a fraction of train.lr)"),
    ("eval.batches=0", "eval.batches=0 must be at least 1"),
    ("data.source=", "data.source is empty; set it to 'stdlib', or a file, directory or glob"),
    ("model.rope_theta=0", "model.rope_theta=0.0 must be positive"),
    ("model.norm_eps=0", "model.norm_eps=0.0 must be positive"),
    ("model.init_std=0", "model.init_std=0.0 must be positive"),
    ("seed=9223372036854775808", "seed=9223372036854775808 must be below 2**63"),
])
def test_validate_rejects_values_that_would_fail_later(assignment, expected):
  with pytest.raises(ConfigError) as info:
    config.validate(config.apply_overrides(config.base(), [assignment]))
  assert expected in str(info.value)


@pytest.mark.parametrize("assignments, expected", [
    (["lora.base_dtype=nf4"], "lora.base_dtype=nf4 without lora.rank: no LoRA, every weight "
     "trains; set lora.rank (e.g. 16) to train adapters, or leave it unset"),
    (["data.chat_template=chat.jinja"], "data.chat_template=chat.jinja with data.format='text':"
     " it applies to fine-tuning records only (data.format=chat|prompt_completion); set "
     "data.format, or leave it unset"),
    (["data.overlong=drop", "data.chat_template=chat.jinja"],
     "data.chat_template=chat.jinja, data.overlong=drop with data.format='text': they apply"),
])
def test_settings_that_would_do_nothing_are_one_line(assignments, expected):
  """A QLoRA setting without lora.rank would train every weight in full, silently; a
  fine-tuning setting on a text run would do nothing. Left at their defaults, they pass."""
  with pytest.raises(ConfigError) as info:
    config.validate(config.apply_overrides(config.base(), assignments))
  assert expected in str(info.value) and "\n" not in str(info.value)
  config.validate(config.apply_overrides(config.base(), [
      *assignments, "lora.rank=4", "data.format=chat", "data.source=x.jsonl"]))
  config.validate(config.apply_overrides(config.base(), [
      "lora.alpha=16", "lora.targets=all-linear", "lora.base_dtype=", "data.overlong=truncate"]))


@pytest.mark.parametrize("assignments, expected", [
    (["data.source=corpus/*.txt", "data.max_bytes=1000"], "data.max_bytes=1000 caps the "
     "built-in stdlib corpus; data.source='corpus/*.txt' is read whole"),
    (["data.eos_token=<|eot_id|>"], "data.eos_token='<|eot_id|>' names a token of a Hugging "
     "Face tokenizer; data.tokenizer='byte' ends each document with byte 0"),
    (["train.steps=2", "profile.steps=5:6"], "profile.steps='5:6' starts after train.steps=2: "
     "nothing would be traced; trace steps from 1 to 2")])
def test_settings_that_could_never_take_effect_are_one_line(assignments, expected):
  """They were accepted and silently did nothing."""
  with pytest.raises(ConfigError, match=re.escape(expected)):
    config.validate(config.apply_overrides(config.base(), assignments))


def test_lora_rank_0_turns_a_lora_presets_adapters_off_for_a_full_fine_tune_baseline():
  """Its alpha, targets and dropout stay as the preset sets them; only a quantized base
  shows that adapters were meant (test_settings_that_would_do_nothing_are_one_line)."""
  config.validate(config.apply_overrides(config.base(), [
      "lora.rank=0", "lora.alpha=32", "lora.targets=q,v", "lora.dropout=0.1"]))


def test_strategy_is_an_alternative_spelling_of_stage():
  for name, (stage, hybrid) in config.STRATEGIES.items():
    cfg = config.apply_overrides(config.base(), [f"zero.strategy={name}"])
    assert cfg.zero.resolved == (stage, hybrid)
  assert config.base().zero.resolved == (3, False)


def test_set_stage_or_hybrid_over_a_strategy_is_the_one_that_runs():
  """--set zero.stage or zero.hybrid spells out a strategy set before it; a later
  zero.strategy decides again."""
  full = config.apply_overrides(config.base(), ["zero.strategy=FULL_SHARD"])
  cases = {("zero.stage=2",): (2, False, ""), ("zero.hybrid=true",): (3, True, ""),
           ("zero.stage=2", "zero.strategy=HYBRID_SHARD"): (2, False, "HYBRID_SHARD")}
  for sets, (stage, hybrid, strategy) in cases.items():
    zero = config.apply_overrides(full, list(sets)).zero
    assert (zero.stage, zero.hybrid, zero.strategy) == (stage, hybrid, strategy), sets
  assert config.apply_overrides(full, ["zero.stage=1"]).zero.resolved == (1, False)


def test_mesh_shape_resolves_minus_one_and_rejects_misfits():
  cfg = config.apply_overrides(config.base(), ["mesh.replica=2", "mesh.fsdp=-1"])
  assert mesh.resolve_shape(cfg.mesh, 8) == (2, 4, 1)
  cfg = config.apply_overrides(config.base(), ["mesh.replica=3"])
  with pytest.raises(ConfigError, match="does not fit 8 devices"):
    mesh.resolve_shape(cfg.mesh, 8)
  cfg = config.apply_overrides(config.base(), ["mesh.replica=2", "mesh.fsdp=2"])
  with pytest.raises(ConfigError, match="product must equal the device count"):
    mesh.resolve_shape(cfg.mesh, 8)


def test_micro_batch_arithmetic():
  cfg = config.apply_overrides(config.base(), ["train.global_batch=32", "train.grad_accum=2"])
  assert mesh.micro_batch(cfg.train, 8) == 2
  cfg = config.apply_overrides(config.base(), ["train.global_batch=20", "train.grad_accum=2"])
  with pytest.raises(ConfigError, match="global_batch=20 is not divisible .* multiple of 16"):
    mesh.micro_batch(cfg.train, 8)


def test_moved_key_keeps_its_old_name_with_a_deprecation_line(caplog):
  with caplog.at_level("WARNING"):
    cfg = config.apply_overrides(config.base(), ["model.hf_checkpoint=/models/llama"])
  assert cfg.init.hf_checkpoint == "/models/llama"
  assert "model.hf_checkpoint is deprecated; it is now init.hf_checkpoint" in caplog.text


def test_load_rejects_missing_file_and_lists_presets(tmp_path):
  with pytest.raises(ConfigError, match="does not exist; presets are in configs/: .*tiny_zero3.py"):
    config.load(str(tmp_path / "nope.py"))


def test_validate_rejects_param_offload_below_stage_3():
  cfg = config.apply_overrides(config.base(), ["zero.stage=2", "offload.params=pinned_host"])
  with pytest.raises(ConfigError, match="needs ZeRO stage 3"):
    config.validate(cfg)


def test_every_preset_loads():
  for path in sorted(CONFIGS.glob("*.py")):
    cfg = config.load(str(path))  # validated, field types included
    assert dataclasses.is_dataclass(cfg), path


def _replaced(section: str, **fields) -> config.Config:
  cfg = config.base()
  return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section),
                                                                  **fields)})


@pytest.mark.parametrize("cfg, expected", [
    (_replaced("train", global_batch=256 / 2), "train.global_batch=128.0 must be an int"),
    (_replaced("train", lr="3e-4"), "train.lr='3e-4' must be a float"),
    (_replaced("mesh", fsdp=8.0), "mesh.fsdp=8.0 must be an int"),
    (_replaced("train", steps=True), "train.steps=True must be an int"),
    (_replaced("model", tie_embeddings=1), "model.tie_embeddings=1 must be True or False"),
    (_replaced("data", source=None), "data.source=None must be a string"),
    (_replaced("remat", block="Block"), "remat.block='Block' must be a class or None"),
    (_replaced("zero", stage=3.0), "zero.stage=3.0 is not valid; choose one of: 0, 1, 2, 3"),
    (dataclasses.replace(config.base(), train={"steps": 3}),
     "train={'steps': 3} must be a TrainConfig section"),
])
def test_a_field_of_the_wrong_type_is_one_line(cfg, expected):
  with pytest.raises(ConfigError) as info:
    config.validate(cfg)
  assert str(info.value) == expected


def test_an_int_is_a_float_and_none_is_an_optional():
  config.validate(_replaced("train", lr=1, clip_norm=0))
  config.validate(_replaced("remat", block=None))


@pytest.mark.parametrize("name, expected", [
    ("cfg.json", "a DeepSpeed config (JSON) goes to jaxzero.train --deepspeed, over such a file"),
    ("fsdp.yaml", "an Accelerate config (YAML) goes to jaxzero.train --accelerate-config, over"),
    ("config", "--deepspeed and an Accelerate config (YAML) goes to jaxzero.train "
     "--accelerate-config"),
])
def test_a_config_that_is_not_python_points_to_its_flag(name, expected, tmp_path):
  path = tmp_path / name
  path.write_text("")
  with pytest.raises(ConfigError) as info:
    config.load(str(path))
  message = str(info.value)
  assert message.startswith(f"config file {str(path)!r} is not a Python file: a config is a "
                            ".py file defining get_config()") and expected in message, message


def test_a_config_directory_is_named_as_one():
  with pytest.raises(ConfigError, match="config file '.*configs' is a directory; name a .py "
                     "file in it: .*tiny_zero3.py"):
    config.load(str(CONFIGS))


@pytest.mark.parametrize("source, expected", [
    ("def get_config(:\n  pass\n", "line 1: SyntaxError: "),
    ("import no_such_module_here\n", "line 1: ModuleNotFoundError: No module named "
     "'no_such_module_here'"),
    ("x = 1\n", "defines no get_config()"),
    ("def get_config():\n  return 1 / 0\n", "line 2: ZeroDivisionError: division by zero"),
])
def test_a_config_file_that_does_not_load_is_one_line_naming_the_line(source, expected,
                                                                     tmp_path):
  path = tmp_path / "broken.py"
  path.write_text(source)
  with pytest.raises(ConfigError) as info:
    config.load(str(path))
  message = str(info.value)
  assert str(path) in message and expected in message and "\n" not in message, message


def test_a_model_factory_run_is_not_checked_against_the_built_in_model_s_fields():
  """mesh.tensor and the model.* numbers are the built-in Llama's; a model_factory model's
  own shapes are checked once it is built (jaxzero.parallel.zero)."""
  config.validate(config.apply_overrides(config.base(), [
      "model_factory=mymodule:build", "mesh.tensor=8", "model.n_heads=3"]))


def test_settings_that_do_not_do_what_they_seem_are_said_at_start():
  assert config.notices(config.base()) == []
  said = config.notices(config.apply_overrides(config.base(), [
      "train.steps=100", "train.warmup_steps=500", "offload.nvme_dir=/nvme",
      "data.eval_fraction=0.01"]))
  assert [line.split(" ")[0] for line in said] == [
      "train.warmup_steps=500", "offload.nvme_dir='/nvme'", "data.eval_fraction=0.01"]
  assert "never reaches train.lr=" in said[0] and "never evaluates" in said[2]
  # DPU's warm-up: unused without DPU, or so long that DPU never runs.
  for sets, expected in ((["offload.delayed_update_after=5"], "delayed_update is off"),
                         (["offload.optimizer=pinned_host", "offload.delayed_update=true",
                           "train.steps=40"], "every step is exact, DPU never runs")):
    said = config.notices(config.apply_overrides(config.base(), sets))
    assert len(said) == 1 and expected in said[0], said
