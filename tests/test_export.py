"""PEFT export and import against real peft + transformers: same keys, same outputs, round trips."""

import dataclasses
import json
import warnings
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from safetensors.numpy import load_file
from transformers import LlamaForCausalLM as HFLlamaForCausalLM

from conftest import run_model
from converter import convert
from demo.tiny import build_tiny_model
from export.cli import main as export_main
from jaxmodel.formats.peft_adapter import AdapterError, load_peft_adapter, read_adapter, save_peft_adapter
from finetune.config import TrainConfig
from finetune.train.loop import run_training
from jaxmodel import load_pretrained
from jaxmodel.layers import LoRAParam
from jaxmodel.lora import ALL_TARGETS, LoraConfig, apply_lora

IDS = np.random.default_rng(5).integers(6, 512, (2, 19))


def tolerance(expected: np.ndarray, bound: float) -> float:
    """`bound` per unit of logit magnitude: float32 rounding grows with the logits, and the tiny test
    models (init std 0.2) reach |logit| ~ 3.5, where torch and XLA summation orders differ by ~1.4e-5."""
    return bound * max(1.0, float(np.abs(expected).max()))


def jax_lora_model(jax_dir, lora_config: LoraConfig, seed=1):
    """The converted model with adapters whose B is non-zero, so they move the output, and drawn from a key
    of its own per module (a hash of its path): no two modules share an A or a B, so exporting one
    module's matrix under another's key changes the output."""
    model = load_pretrained(jax_dir)
    apply_lora(model, lora_config, rngs=nnx.Rngs(seed))
    for path, var in nnx.to_flat_state(nnx.state(model, LoRAParam)):
        if path[-1] == "lora_b":
            key = jax.random.key(zlib.crc32(".".join(map(str, path)).encode()))
            var.set_value(0.05 * jax.random.normal(key, var[...].shape))
    return model


def assert_every_matrix_differs(model):
    """No two (module, layer) adapter matrices are equal, A or B."""
    seen = {}
    for path, var in nnx.to_flat_state(nnx.state(model, LoRAParam)):
        for layer, matrix in enumerate(np.asarray(var[...])):
            seen[(".".join(map(str, path)), layer)] = matrix.tobytes()
    assert len(set(seen.values())) == len(seen)


def peft_logits(hf_dir, adapter_dir) -> tuple[np.ndarray, np.ndarray, list]:
    base = HFLlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        plain = base(torch.tensor(IDS)).logits.numpy()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = PeftModel.from_pretrained(base, adapter_dir).eval()
    messages = [str(w.message) for w in caught if "is_gradient_checkpointing" not in str(w.message)]
    with torch.no_grad():
        adapted = model(torch.tensor(IDS)).logits.numpy()
    return adapted, plain, messages


@pytest.mark.parametrize("lora_kw", [{}, {"rslora": True, "alpha": 8.0, "rank": 4},
                                     {"targets": ("q_proj", "v_proj", "down_proj"), "rank_pattern": {"down_proj": 3},
                                      "alpha_pattern": {"v_proj": 5.0, "down_proj": 2.0}}])
@pytest.mark.slow
def test_peft_serves_our_adapter_with_identical_outputs(tmp_path, tiny_checkpoint, tiny_converted, lora_kw):
    lora_config = LoraConfig(**lora_kw)
    model = jax_lora_model(tiny_converted, lora_config)
    assert_every_matrix_differs(model)
    adapter = save_peft_adapter(tmp_path / "adapter", nnx.state(model, LoRAParam), lora_config,
                                model_config=model.config, base_model=str(tiny_checkpoint))
    ours = np.asarray(model(jnp.asarray(IDS, jnp.int32)))
    theirs, plain, messages = peft_logits(tiny_checkpoint, adapter)
    assert not any("missing" in m.lower() for m in messages), messages
    assert np.abs(theirs - plain).max() > 1e-3  # the adapter really moves the output
    assert np.abs(ours - theirs).max() <= tolerance(theirs, 1e-5)


def test_keys_and_shapes_equal_what_peft_saves(tmp_path, tiny_checkpoint, tiny_converted):
    lora_config = LoraConfig(rank=8, alpha=16.0)
    model = jax_lora_model(tiny_converted, lora_config)
    save_peft_adapter(tmp_path / "ours", nnx.state(model, LoRAParam), lora_config,
                      model_config=model.config, base_model="x")
    hf = HFLlamaForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    get_peft_model(hf, PeftLoraConfig(r=8, lora_alpha=16, target_modules=list(ALL_TARGETS),
                                      task_type="CAUSAL_LM")).save_pretrained(tmp_path / "theirs")
    ours, theirs = load_file(tmp_path / "ours" / "adapter_model.safetensors"), \
        load_file(tmp_path / "theirs" / "adapter_model.safetensors")
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}
    assert {v.dtype for v in ours.values()} == {np.dtype(np.float32)}
    our_config = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    their_config = json.loads((tmp_path / "theirs" / "adapter_config.json").read_text())
    assert set(our_config) == set(their_config)
    for field in ("peft_type", "task_type", "r", "lora_alpha", "use_rslora", "bias", "use_dora", "fan_in_fan_out"):
        assert our_config[field] == their_config[field], field
    assert sorted(our_config["target_modules"]) == sorted(their_config["target_modules"])
    assert "base_model: x" in (tmp_path / "ours" / "README.md").read_text()


def test_tied_embeddings_and_bf16_export(tmp_path):
    hf_dir = build_tiny_model(tmp_path / "hf", {"tie_word_embeddings": True}, tokenizer=False)
    convert(hf_dir, tmp_path / "jax", progress=False)
    lora_config = LoraConfig()
    model = jax_lora_model(tmp_path / "jax", lora_config)
    ours = np.asarray(model(jnp.asarray(IDS, jnp.int32)))
    f32 = save_peft_adapter(tmp_path / "f32", nnx.state(model, LoRAParam), lora_config,
                            model_config=model.config, base_model=str(hf_dir))
    theirs, _, _ = peft_logits(hf_dir, f32)
    assert np.abs(ours - theirs).max() <= tolerance(theirs, 1e-5)
    bf16 = save_peft_adapter(tmp_path / "bf16", nnx.state(model, LoRAParam), lora_config,
                             model_config=model.config, base_model=str(hf_dir),
                             dtype="bfloat16")
    exported, exported_f32 = load_file(bf16 / "adapter_model.safetensors"), load_file(f32 / "adapter_model.safetensors")
    assert {str(v.dtype) for v in exported.values()} == {"bfloat16"}
    for name, value in exported.items():  # rounded to nearest even, as torch's .to(bfloat16)
        want = torch.from_numpy(exported_f32[name]).to(torch.bfloat16).view(torch.int16).numpy()
        np.testing.assert_array_equal(value.view(np.int16), want, err_msg=name)
    theirs_bf16, plain, _ = peft_logits(hf_dir, bf16)
    # Rounding A and B to bf16 changes each entry by at most u = 2^-8 of itself, so the adapter's delta
    # scale * A B moves by about 2u = 1 bf16 ulp (2^-7) of itself, and to first order the logits' adapter
    # contribution by the same fraction: the bound is 1 ulp of the adapter's effect on the logits (measured:
    # 0.24 ulp, errors of random sign partly cancel), 128x below the effect itself.
    effect = np.abs(theirs - plain).max()
    rounding = np.abs(theirs_bf16 - theirs).max()
    assert effect > 1.0  # the adapter moves the logits by O(1)
    assert 0 < rounding <= 2.0**-7 * effect


def test_round_trip_peft_to_jax_to_peft_is_exact(tmp_path, tiny_checkpoint, tiny_converted):
    hf = HFLlamaForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    config = PeftLoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "up_proj"], use_rslora=True,
                            rank_pattern={"k_proj": 2}, alpha_pattern={r"layers\.\d+\.mlp\.up_proj": 3},
                            init_lora_weights=False, task_type="CAUSAL_LM")  # random, non-zero B
    get_peft_model(hf, config).save_pretrained(tmp_path / "peft")
    model = load_peft_adapter(load_pretrained(tiny_converted), tmp_path / "peft")
    lora_config = LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "k_proj", "up_proj"), rslora=True,
                             rank_pattern={"k_proj": 2}, alpha_pattern={"up_proj": 3.0})
    read = read_adapter(tmp_path / "peft")[0]
    assert dataclasses.replace(read, targets=tuple(sorted(read.targets))) == \
        dataclasses.replace(lora_config, targets=tuple(sorted(lora_config.targets)))
    save_peft_adapter(tmp_path / "again", nnx.state(model, LoRAParam), lora_config,
                      model_config=model.config, base_model="x")
    first, again = load_file(tmp_path / "peft" / "adapter_model.safetensors"), \
        load_file(tmp_path / "again" / "adapter_model.safetensors")
    assert first.keys() == again.keys()
    for name in first:
        np.testing.assert_array_equal(again[name], first[name], err_msg=name)
    theirs, _, _ = peft_logits(tiny_checkpoint, tmp_path / "peft")
    ours = np.asarray(model(jnp.asarray(IDS, jnp.int32)))
    assert np.abs(ours - theirs).max() <= tolerance(theirs, 1e-5)


def test_unsupported_or_mismatched_adapters_are_clear_errors(tmp_path, tiny_checkpoint, tiny_converted):
    hf = HFLlamaForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    get_peft_model(hf, PeftLoraConfig(r=4, target_modules=["q_proj"], use_dora=True)).save_pretrained(tmp_path / "dora")
    with pytest.raises(AdapterError, match="field 'use_dora' is True; not supported"):
        load_peft_adapter(load_pretrained(tiny_converted), tmp_path / "dora")
    other = build_tiny_model(tmp_path / "other", {"hidden_size": 32, "head_dim": 8}, tokenizer=False)
    hf_other = HFLlamaForCausalLM.from_pretrained(other, dtype=torch.float32)
    get_peft_model(hf_other, PeftLoraConfig(r=4, target_modules=["q_proj"])).save_pretrained(tmp_path / "small")
    with pytest.raises(AdapterError, match=r"has lora_A \[4, 32\].*this model needs \[4, 64\].*another model"):
        load_peft_adapter(load_pretrained(tiny_converted), tmp_path / "small")
    config = json.loads((tmp_path / "small" / "adapter_config.json").read_text())
    config["peft_type"] = "IA3"
    (tmp_path / "small" / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(AdapterError, match="field 'peft_type' is 'IA3'; only 'LORA'"):
        load_peft_adapter(load_pretrained(tiny_converted), tmp_path / "small")


@pytest.fixture(scope="module")
def run_dir(tiny_converted, tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "run"
    data = out.parent / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"add {i} + {i} =", "completion": f" {2 * i}"}) + "\n"
                            for i in range(32)))
    run_training(TrainConfig(model=str(tiny_converted), data=str(data), out=str(out), steps=4, batch_size=8, seq_len=32,
                      dtype="float32", lr=1e-2, progress=False, checkpoint_every=2).validate())
    return out


@pytest.mark.slow
def test_export_peft_cli_from_a_run(tmp_path, run_dir, tiny_checkpoint, tiny_converted, capsys):
    assert export_main(["--run", str(run_dir), "--out", str(tmp_path / "adapter"), "--base-model",
                        str(tiny_checkpoint)]) == 0
    assert "exported the LoRA adapters of step 4" in capsys.readouterr().out
    model = load_peft_adapter(load_pretrained(tiny_converted), tmp_path / "adapter")
    theirs, plain, _ = peft_logits(tiny_checkpoint, tmp_path / "adapter")
    assert np.abs(theirs - plain).max() > 1e-3
    ours = np.asarray(model(jnp.asarray(IDS, jnp.int32)))
    assert np.abs(ours - theirs).max() <= tolerance(theirs, 1e-5)
    assert export_main(["--run", str(run_dir), "--step", "2", "--out", str(tmp_path / "step2")]) == 0


@pytest.mark.parametrize("make_args, message", [
    (lambda run, tmp: ["--run", str(run), "--step", "3"], "no checkpoint for step 3 (have: 2, 4)"),
    (lambda run, tmp: ["--run", str(tmp)], "not a finetune-lora run directory"),
])
@pytest.mark.slow
def test_export_peft_bad_input(tmp_path, run_dir, capsys, make_args, message):
    code = export_main(make_args(run_dir, tmp_path) + ["--out", str(tmp_path / "adapter")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and message in err[0], err
    assert not (tmp_path / "adapter").exists()


@pytest.mark.slow
def test_run_without_checkpoints_is_a_clear_error(tmp_path, run_dir, capsys):
    import shutil

    broken = tmp_path / "broken"
    broken.mkdir()
    shutil.copy(run_dir / "run_config.json", broken / "run_config.json")
    assert export_main(["--run", str(broken), "--out", str(tmp_path / "adapter")]) == 1
    assert "no LoRA checkpoints" in capsys.readouterr().err


@pytest.mark.slow
def test_run_config_with_unknown_options_is_one_line(tmp_path, run_dir, capsys):
    import shutil

    odd = tmp_path / "odd"
    shutil.copytree(run_dir, odd)
    config = json.loads((odd / "run_config.json").read_text())
    (odd / "run_config.json").write_text(json.dumps({**config, "warp_drive": True}))
    assert export_main(["--run", str(odd), "--out", str(tmp_path / "adapter")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"export-peft: error: {odd / 'run_config.json'}: unknown option 'warp_drive' "
                   "(written by another version of finetune-lora?)"]
    assert not (tmp_path / "adapter").exists()


@pytest.mark.slow
def test_finetune_can_start_from_a_peft_adapter(tmp_path, run_dir, tiny_checkpoint, tiny_converted):
    hf = HFLlamaForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    get_peft_model(hf, PeftLoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
                                      rank_pattern={"v_proj": 2}, alpha_pattern={"q_proj": 3},
                                      task_type="CAUSAL_LM")).save_pretrained(tmp_path / "peft")
    out = tmp_path / "run"
    run_training(TrainConfig(model=str(tiny_converted), data=str(run_dir.parent / "train.jsonl"), out=str(out), steps=1,
                      batch_size=8, seq_len=32, dtype="float32", lr=1e-9, progress=False,
                      init_adapter=str(tmp_path / "peft")).validate())
    recorded = json.loads((out / "run_config.json").read_text())
    assert (recorded["rank"], recorded["alpha"], recorded["targets"], recorded["rank_pattern"],
            recorded["alpha_pattern"]) == (4, 8.0, "q_proj,v_proj", "v_proj=2", "q_proj=3.0")
    assert export_main(["--run", str(out), "--out", str(tmp_path / "again")]) == 0
    first = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    again = load_file(tmp_path / "again" / "adapter_model.safetensors")
    assert first.keys() == again.keys()
    for name in first:  # one step at lr 1e-9 barely moves them
        np.testing.assert_allclose(again[name], first[name], atol=1e-6, err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("shard_size", ["5GB", "100KB"])
def test_merged_checkpoint_loads_in_transformers_with_the_lora_logits(tmp_path, run_dir, tiny_converted, shard_size,
                                                                      capsys):
    out = tmp_path / "merged"
    assert export_main(["--run", str(run_dir), "--merge", str(out), "--max-shard-size", shard_size]) == 0
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert (files == ["model.safetensors"]) == (shard_size == "5GB")
    assert (out / "model.safetensors.index.json").is_file() == (shard_size != "5GB")
    assert (out / "tokenizer.json").is_file() and (out / "config.json").is_file()
    merged = HFLlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = merged(torch.tensor(IDS)).logits.numpy()
    ours = np.asarray(run_model(run_dir, tiny_converted)(jnp.asarray(IDS, jnp.int32)))
    plain = np.asarray(load_pretrained(tiny_converted)(jnp.asarray(IDS, jnp.int32)))
    assert np.abs(ours - plain).max() > 1e-3
    assert np.abs(ours - theirs).max() <= tolerance(theirs, 1e-4)


@pytest.mark.slow
def test_bad_shard_size(tmp_path, run_dir, capsys):
    assert export_main(["--run", str(run_dir), "--merge", str(tmp_path / "m"), "--max-shard-size", "lots"]) == 2
    assert "--max-shard-size 'lots': expected a size" in capsys.readouterr().err


@pytest.mark.parametrize("field, value", [
    ("modules_to_save", ["lm_head"]), ("rank_pattern", {r"model\.layers\.0\.self_attn\.q_proj": 16}),
    ("alpha_pattern", {"layers.1.self_attn.v_proj": 4}), ("rank_pattern", {"(": 4}), ("layers_to_transform", [0]),
    ("bias", "all"), ("target_modules", "q_proj|v_proj")])
def test_peft_variants_we_do_not_run_are_refused(tmp_path, tiny_converted, field, value):
    """A pattern that gives a target's layers different values (PEFT's per-layer ranks) is one of them."""
    model = jax_lora_model(tiny_converted, LoraConfig(targets=("q_proj", "v_proj")))
    adapter = save_peft_adapter(tmp_path / "a", nnx.state(model, LoRAParam), LoraConfig(targets=("q_proj", "v_proj")),
                                model_config=model.config, base_model="x")
    config = json.loads((adapter / "adapter_config.json").read_text())
    config[field] = value
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(AdapterError, match=f"field '{field}'"):
        load_peft_adapter(load_pretrained(tiny_converted), adapter)
