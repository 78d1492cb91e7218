"""ModelConfig.from_hf: both config dialects, defaults, and clear errors. TrainConfig.validate: every numeric
finetune-lora option refused out of its range at parse time, and a LoRA rank the model's layers cannot hold.
TrainConfig's fields: each declares its resume policy, and the sets the run and --fit use follow the declarations."""

import dataclasses
import json
from typing import get_args, get_type_hints

import pytest
from hypothesis import given
from strategies import llama_configs
from transformers import LlamaConfig as HFLlamaConfig

from finetune.cli import main
from finetune.config import (OPTION_RANGES, Allowed, ConfigFileError, NotCompared, Refused, TrainConfig, load_config,
                             option)
from finetune.planning.fit import PLAN_ONLY
from finetune.run.policy import IMMUTABLE, MUTABLE, NOT_COMPARED
from jaxmodel.config import ConfigError, ModelConfig, RopeConfig

LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
    "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16",
}


def test_legacy_llama_31_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_31_8B))
    config = ModelConfig.from_hf(tmp_path)
    assert config.head_dim == 128 and config.num_key_value_heads == 8
    assert config.rope == RopeConfig("llama3", 500000.0, 8.0, 1.0, 4.0, 8192)
    assert config.eos_token_ids == (128001,)


def test_transformers5_dialect_equals_legacy():
    legacy = ModelConfig.from_hf(LLAMA_31_8B)
    v5 = HFLlamaConfig(**{k: v for k, v in LLAMA_31_8B.items() if k != "torch_dtype"}).to_dict()
    assert "rope_parameters" in v5 and "rope_scaling" not in v5
    assert ModelConfig.from_hf(v5) == legacy


@given(llama_configs())
def test_drawn_configs_round_trip_through_transformers(raw):
    config = ModelConfig.from_hf(raw)
    hf = HFLlamaConfig(**raw)
    assert config.head_dim == hf.head_dim
    via_hf = ModelConfig.from_hf(hf.to_dict())  # transformers fills in its default special-token ids
    assert dataclasses.replace(via_hf, bos_token_id=None, eos_token_id=None, pad_token_id=None) == config
    assert ModelConfig.from_hf(config.to_hf()) == config


def test_defaults_for_optional_fields():
    config = ModelConfig.from_hf({"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
                                  "num_hidden_layers": 1, "num_attention_heads": 2})
    assert (config.num_key_value_heads, config.head_dim) == (2, 4)
    assert config.rope == RopeConfig("default", 10000.0)
    assert not config.tie_word_embeddings


@pytest.mark.parametrize("change, message", [
    ({"model_type": "gemma"},
     "field 'model_type' is 'gemma'; supported: llama, mistral, qwen2, qwen3, gemma3_text, gemma3"),
    ({"hidden_act": "gelu"}, "field 'hidden_act'"),
    ({"num_key_value_heads": 3}, "'num_key_value_heads' (3) must divide num_attention_heads (32)"),
    ({"vocab_size": None}, "field 'vocab_size' is missing"),
    ({"hidden_size": -4}, "'hidden_size' must be a positive integer"),
    ({"tie_word_embeddings": "yes"}, "'tie_word_embeddings' must be bool"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "'rope_scaling.rope_type' is 'dynamic'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "'rope_scaling.low_freq_factor' must be"),
])
def test_bad_fields_are_named(change, message):
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_hf({**LLAMA_31_8B, **change})
    assert message in str(info.value)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="config.json: not found"):
        ModelConfig.from_hf(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="expected a JSON object"):
        ModelConfig.from_hf(tmp_path)


# ---- TrainConfig.validate: finetune-lora's option ranges ----------------------------------------------

BAD_OPTIONS = [
    (["--seed", "-1"], "--seed must be an integer in [0, 2**63), got -1"),
    (["--seed", str(2**63)], f"--seed must be an integer in [0, 2**63), got {2**63}"),
    (["--stop-after", "-3"], "--stop-after must be 0 or a positive integer, got -3"),
    (["--warmup-steps", "-1"], "--warmup-steps must be 0 or a positive integer, got -1"),
    (["--eval-every", "-2"], "--eval-every must be 0 or a positive integer, got -2"),
    (["--clip-norm", "-1"], "--clip-norm must be a finite number >= 0, got -1.0"),
    (["--clip-norm", "inf"], "--clip-norm must be a finite number >= 0, got inf"),
    (["--alpha", "-16"], "--alpha must be a finite number > 0, got -16.0"),
    (["--alpha", "0"], "--alpha must be a finite number > 0, got 0.0"),
    (["--min-lr-ratio", "5"], "--min-lr-ratio must be in [0, 1], got 5.0"),
    (["--min-lr-ratio", "-0.1"], "--min-lr-ratio must be in [0, 1], got -0.1"),
    (["--adam-b1", "1.5"], "--adam-b1 must be in [0, 1), got 1.5"),
    (["--adam-b1", "1"], "--adam-b1 must be in [0, 1), got 1.0"),
    (["--adam-b2", "-0.5"], "--adam-b2 must be in [0, 1), got -0.5"),
    (["--adam-eps", "0"], "--adam-eps must be a finite number > 0, got 0.0"),
    (["--weight-decay", "-0.1"], "--weight-decay must be a finite number >= 0, got -0.1"),
    (["--lora-dropout", "1"], "--lora-dropout must be in [0, 1), got 1.0"),
    (["--lr", "nan"], "--lr must be a finite number > 0, got nan"),
    (["--lr", "inf"], "--lr must be a finite number > 0, got inf"),
    (["--lr=-1e-4"], "--lr must be a finite number > 0, got -0.0001"),
    (["--hbm-gb", "0"], "--hbm-gb must be a finite number > 0, got 0.0"),
    (["--eval-fraction", "nan"], "--eval-fraction must be in [0, 1), got nan"),
    (["--rank", "0"], "--rank must be a positive integer, got 0"),
    (["--seq-len", "1"], "--seq-len must be an integer >= 2 (a token's target is the next token), got 1"),
    (["--steps", "0"], "--steps must be a positive integer, got 0"),
    (["--batch-size", "-8"], "--batch-size must be a positive integer, got -8"),
    (["--grad-accum", "0"], "--grad-accum must be a positive integer, got 0"),
    (["--log-every", "0"], "--log-every must be a positive integer, got 0"),
    (["--checkpoint-every", "0"], "--checkpoint-every must be a positive integer, got 0"),
    (["--keep-checkpoints", "0"], "--keep-checkpoints must be a positive integer, got 0"),
    (["--loss-chunk", "-1"], "--loss-chunk must be 0 or a positive integer, got -1"),
    (["--mlp-chunk", "-1"], "--mlp-chunk must be 0 or a positive integer, got -1"),
    (["--num-processes", "0"], "--num-processes must be a positive integer, got 0"),
    (["--process-id", "-1"], "--process-id must be 0 or a positive integer, got -1"),
]


@pytest.mark.parametrize("args, message", BAD_OPTIONS, ids=[" ".join(a) for a, _ in BAD_OPTIONS])
def test_out_of_range_options_are_one_line_usage_errors_before_anything_is_created(tmp_path, capsys, args, message):
    out = tmp_path / "run"
    code = main(["--model", str(tmp_path / "model"), "--data", str(tmp_path / "d.jsonl"), "--out", str(out), *args])
    assert (code, capsys.readouterr().err.splitlines()) == (2, [f"finetune-lora: error: {message}"])
    assert not out.exists()


def test_a_non_finite_value_in_a_yaml_config_is_refused(tmp_path, capsys):
    (tmp_path / "run.yaml").write_text(f"model: m\ndata: d.jsonl\nout: {tmp_path / 'run'}\nlr: .nan\n")
    assert main(["--config", str(tmp_path / "run.yaml")]) == 2
    assert capsys.readouterr().err.splitlines() == ["finetune-lora: error: --lr must be a finite number > 0, got nan"]
    assert not (tmp_path / "run").exists()


def test_every_numeric_option_has_a_range():
    """A new int/float option must state its range in OPTION_RANGES (validate() checks each one)."""
    hints = get_type_hints(TrainConfig)
    numeric = {f.name for f in dataclasses.fields(TrainConfig)
               if {int, float} & ({hints[f.name]} | set(get_args(hints[f.name])))}
    assert numeric == set(OPTION_RANGES)


def test_the_edges_of_every_range_are_accepted():
    edges = {"seed": 0, "stop_after": 0, "warmup_steps": 0, "eval_every": 0, "clip_norm": 0.0, "min_lr_ratio": 1.0,
             "adam_b1": 0.0, "adam_b2": 0.0, "weight_decay": 0.0, "lora_dropout": 0.0, "eval_fraction": 0.0,
             "seq_len": 2, "loss_chunk": 0, "mlp_chunk": 0, "process_id": 0, "num_processes": 1}
    TrainConfig(model="m", data="d", out="o", **edges).validate()
    TrainConfig(model="m", data="d", out="o", seed=2**63 - 1, min_lr_ratio=0.0, alpha=1e-6, adam_eps=1e-30).validate()


def test_choices_are_checked_for_configs_built_in_python():
    with pytest.raises(ConfigFileError, match="^--dtype must be one of bfloat16, float32, got 'float16'$"):
        TrainConfig(model="m", data="d", out="o", dtype="float16").validate()


@pytest.mark.parametrize("args, message", [
    (["--rank", "33"], "--rank 33 is larger than the smallest adapted layer: k_proj (64 -> 32) allows a rank of at "
                       "most 32"),
    (["--rank", "65", "--targets", "q_proj,o_proj"], "--rank 65 is larger than the smallest adapted layer: q_proj "
                                                     "(64 -> 64) allows a rank of at most 64"),
    (["--rank", "33", "--rank-pattern", "k_proj=32"],
     "--rank 33 is larger than the smallest adapted layer: v_proj (64 -> 32) allows a rank of at most 32"),
    (["--rank-pattern", "k_proj=33"], "--rank-pattern gives k_proj rank 33, larger than its layer (64 -> 32) "
                                      "allows: at most 32"),
    (["--rank-pattern", "k_proj:4"], "--rank-pattern 'k_proj:4': expected TARGET=RANK pairs separated by commas"),
    (["--alpha-pattern", "lm_head=2"], "--rank/--alpha/--targets/--lora-dropout/--rank-pattern/--alpha-pattern: "
                                       "LoRA alpha_pattern names 'lm_head', which is not among the targets"),
])
def test_a_rank_larger_than_a_layer_is_refused_before_the_run_dir_exists(tmp_path, tiny_converted, capsys, args,
                                                                        message):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "the quick fox"}\n')
    out = tmp_path / "run"
    code = main(["--model", str(tiny_converted), "--data", str(data), "--out", str(out), "--seq-len", "32",
                 "--steps", "1", "--batch-size", "8", "--no-progress", *args])
    assert (code, capsys.readouterr().err.splitlines()) == (2, [f"finetune-lora: error: {message}"])
    assert not out.exists()


def test_the_largest_rank_a_layer_holds_is_accepted(tiny_converted):
    from finetune.step.checks import check_rank

    llama = ModelConfig.from_hf(tiny_converted)
    check_rank(TrainConfig(model="m", data="d", out="o", rank=32).validate(), llama)
    check_rank(TrainConfig(model="m", data="d", out="o", rank=64, targets="q_proj,o_proj").validate(), llama)
    check_rank(TrainConfig(model="m", data="d", out="o", rank=64, rank_pattern="k_proj=32",
                           targets="q_proj,k_proj,o_proj").validate(), llama)


# ---- each option's policy, declared beside it ----------------------------------------------------------


def test_every_option_declares_one_resume_policy_and_the_derived_sets_follow_it():
    declared = {Refused: {}, Allowed: {}, NotCompared: {}}
    for f in dataclasses.fields(TrainConfig):
        policy = f.metadata["resume"]
        assert type(policy) in declared and policy.why, f.name
        declared[type(policy)][f.name] = policy.why
        assert isinstance(f.metadata["plan_only"], bool), f.name
    assert IMMUTABLE == declared[Refused]
    assert MUTABLE == declared[Allowed]
    assert NOT_COMPARED == tuple(declared[NotCompared])
    assert set(PLAN_ONLY) == {f.name for f in dataclasses.fields(TrainConfig) if f.metadata["plan_only"]}
    # a plan-only option describes no part of the run, so a resume has nothing to refuse it for
    assert all(isinstance(TrainConfig.__dataclass_fields__[name].metadata["resume"], Allowed) for name in PLAN_ONLY)


def test_an_option_without_a_resume_policy_cannot_be_defined():
    with pytest.raises(TypeError, match="resume"):
        @dataclasses.dataclass(frozen=True)
        class Config:
            new_option: int = option(1, "a new option")
    with pytest.raises(TypeError, match="resume= must be Refused, Allowed or NotCompared with a reason"):
        option(1, "a new option", resume="allowed")
    with pytest.raises(TypeError, match="resume= must be Refused, Allowed or NotCompared with a reason"):
        option(1, "a new option", resume=Refused(""))


# ---- preference objectives: each knob goes with its objective ------------------------------------------


@pytest.mark.parametrize("flags,message", [
    (["--beta", "0.2"], "--beta goes with --objective dpo, ipo, simpo, grpo or rloo, not --objective sft"),
    (["--objective", "orpo", "--beta", "0.2"], "--beta goes with"),
    (["--objective", "ipo", "--label-smoothing", "0.1"], "--label-smoothing goes with --objective dpo, not --objective ipo"),
    (["--objective", "dpo", "--simpo-gamma", "1"], "--simpo-gamma goes with --objective simpo"),
    (["--objective", "simpo", "--orpo-lambda", "0.5"], "--orpo-lambda goes with --objective orpo"),
    (["--objective", "simpo", "--reference", "base"], "--reference goes with --objective dpo, ipo, grpo or rloo"),
    (["--objective", "dpo", "--reference", "init"], "--reference init needs --init-adapter"),
    (["--objective", "orpo", "--precompute-reference"],
     "--precompute-reference goes with --objective dpo or ipo, not --objective orpo"),
    (["--objective", "dpo", "--label-smoothing", "0.5"], "--label-smoothing must be in [0, 0.5), got 0.5"),
    (["--objective", "dpo", "--beta", "0"], "--beta must be a finite number > 0, got 0.0"),
    (["--objective", "kto"], "--objective: invalid choice"),
    (["--num-generations", "4"], "--num-generations goes with --objective grpo or rloo, not --objective sft"),
    (["--objective", "dpo", "--reward", "equals:a"],
     "--reward goes with --objective grpo or rloo, not --objective dpo"),
    (["--objective", "rloo", "--reward", "equals:a", "--loss-type", "grpo"],
     "--loss-type goes with --objective grpo, not --objective rloo"),
    (["--objective", "grpo", "--reward", "equals:a", "--normalize-advantages"],
     "--normalize-advantages goes with --objective rloo, not --objective grpo"),
    (["--objective", "grpo"], "--objective grpo needs --reward (path/to/file.py:function, or a built-in: "
                              "equals:COLUMN, regex:PATTERN, last-number:COLUMN)"),
    (["--objective", "grpo", "--reward", "equals:a", "--num-generations", "1"],
     "--num-generations must be at least 2 (a completion's advantage is measured against its prompt's others), got 1"),
    (["--objective", "grpo", "--reward", "equals:a", "--reward", "regex:x", "--reward-weights", "1"],
     "--reward-weights gives 1 weights for 2 --reward functions: give one each"),
    (["--objective", "grpo", "--reward", "equals:a", "--reward-weights", "one"],
     "--reward-weights 'one': expected numbers separated by commas"),
    (["--objective", "grpo", "--reward", "equals:a", "--reference", "base"],
     "--reference goes with --beta > 0 for --objective grpo (with --beta 0 no reference runs)"),
    (["--objective", "grpo", "--reward", "equals:a", "--batch-size", "3", "--num-generations", "3",
      "--grad-accum", "2"], "--batch-size 3 x --num-generations 3 must be a multiple of --grad-accum 2"),
    (["--eval-generate", "4"], "--eval-generate needs held-out prompts: --eval-data or --eval-fraction"),
    (["--objective", "grpo", "--reward", "equals:a", "--temperature", "0"],
     "--temperature must be a finite number > 0, got 0.0"),
    (["--objective", "dpo", "--targets", "q_proj,gate"],
     "--targets gate (the router) goes with --objective sft, not --objective dpo: its load-balancing loss is added "
     "to the SFT loss only"),
])
def test_an_option_of_another_objective_is_one_line_and_exit_2(tmp_path, capsys, flags, message):
    from finetune.cli import main

    try:
        code = main(["--model", "m", "--data", "d", "--out", str(tmp_path / "r"), *flags])
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    assert code == 2 and not (tmp_path / "r").exists()
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and "Traceback" not in "".join(err)


def test_the_reference_follows_the_initial_adapter():
    def reference(**kw):
        return TrainConfig(model="m", data="d", out="o", **kw).validate().reference_model()

    assert reference(objective="dpo") == "base" and reference(objective="ipo", init_adapter="a") == "init"
    assert reference(objective="dpo", init_adapter="a", reference="base") == "base"
    assert reference(objective="simpo") is None and reference(objective="sft") is None


def test_the_online_rl_objectives_take_trls_defaults_where_they_differ():
    """GRPO's beta 0 (no reference pass) and RLOO's 0.05, their learning rate 1e-6 and G (8, 2), as TRL 1.16's
    GRPOConfig and RLOOConfig; the other objectives keep theirs; a given value is the value."""
    from trl import GRPOConfig, RLOOConfig

    def of(**kw):
        return TrainConfig(model="m", data="d", out="o", **kw).validate()

    for objective, trl in (("grpo", GRPOConfig), ("rloo", RLOOConfig)):
        config = of(objective=objective, reward=("equals:a",))
        defaults = {f.name: f.default for f in dataclasses.fields(trl)}
        assert [config.value(n) for n in ("lr", "beta", "num_generations", "max_completion_length", "temperature",
                                          "epsilon", "num_iterations")] == [
            defaults[n] for n in ("learning_rate", "beta", "num_generations", "max_completion_length", "temperature",
                                  "epsilon", "num_iterations")]
        assert config.rows_per_step == config.batch_size * defaults["num_generations"]
        assert config.reference_model() is None if objective == "grpo" else config.reference_model() == "base"
    assert (of().value("lr"), of(objective="dpo").value("beta")) == (1e-4, 0.1)
    assert of(objective="grpo", reward=("equals:a",), beta=0.04, lr=2e-5).value("beta") == 0.04
    assert of(objective="grpo", reward=("equals:a",), beta=0.04).reference_model() == "base"


def test_rewards_repeat_on_the_command_line_and_list_in_yaml(tmp_path):
    flags = ["--model", "m", "--data", "d", "--out", "o", "--objective", "grpo"]
    config = load_config(flags + ["--reward", "r.py:f", "--reward", "regex:a,b"], "t", "t")
    assert config.reward == ("r.py:f", "regex:a,b") and config.reward_weight_values() == (1.0, 1.0)
    (tmp_path / "run.yaml").write_text("reward: [r.py:f, 'regex:^<think>']\nreward_weights: 1,0.5\n")
    config = load_config(flags + ["--config", str(tmp_path / "run.yaml")], "t", "t")
    assert config.reward == ("r.py:f", "regex:^<think>") and config.reward_weight_values() == (1.0, 0.5)
    (tmp_path / "one.yaml").write_text("reward: equals:answer\n")
    assert load_config(flags + ["--config", str(tmp_path / "one.yaml")], "t", "t").reward == ("equals:answer",)
