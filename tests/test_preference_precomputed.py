"""--precompute-reference: the reference computed once before training trains exactly as the one computed in each
step (losses, TRL metrics and evaluation over several steps, on several meshes, two processes, after a resume that
reads the values back from the cache), the cache refuses values whose key changed in any part, and --plan
compiles the step without the reference's forward."""

import dataclasses
import json
import shutil

import jax
import numpy as np
import pytest

from finetune.config import TrainConfig
from finetune.data.reference_logps import load_reference, reference_key, store_reference
from finetune.train.loop import run_training
from test_preference_training import TRL_METRICS, addition_pairs, assert_same_step, config, records, step_on


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in addition_pairs()))
    return path


@pytest.fixture(scope="module")
def eval_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("eval") / "eval.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in addition_pairs(5, seed=1)))
    return path


def assert_same_records(got: list[dict], expected: list[dict], beta: float = 0.1) -> None:
    """Equal losses and metrics within 1e-5: a reward b·(logp - ref) is a difference of two sums of the size of
    logps, so it is compared at 1e-5 of b·|logps|."""
    assert [r["step"] for r in got] == [r["step"] for r in expected]
    for g, e in zip(got, expected):
        scale = beta * max(abs(e.get("logps/chosen", 0.0)), abs(e.get("eval_logps/chosen", 0.0)))
        for name in ("loss", "eval_loss", *TRL_METRICS, *(f"eval_{m}" for m in TRL_METRICS)):
            if name in e:
                assert g[name] == pytest.approx(e[name], rel=1e-5, abs=1e-5 * scale), (g["step"], name)


@pytest.mark.slow
def test_a_precomputed_reference_trains_as_the_in_step_one_and_a_resume_reads_it_back(
        tmp_path, tiny_converted, pairs_file, eval_file, capfd, monkeypatch):
    import finetune.train.loop

    monkeypatch.setattr(finetune.train.loop, "measure_peak_flops", lambda dtype: 1e12)
    kw = dict(eval_data=str(eval_file), data_cache=str(tmp_path / "cache"), eval_every=2)
    run_training(config(tiny_converted, pairs_file, tmp_path / "in-step", **kw))
    capfd.readouterr()
    run_training(config(tiny_converted, pairs_file, tmp_path / "once", precompute_reference=True, **kw))
    err = capfd.readouterr().err
    assert "reference: 48 sequences computed" in err and "reference: 10 sequences computed" in err
    in_step, once = records(tmp_path / "in-step"), records(tmp_path / "once")
    assert_same_records(once, in_step)
    assert {f"eval_{m}" for m in TRL_METRICS} <= set(once[1])
    # no reference forward in the step: MFU counts the policy's 4N + 12·L·T·H only
    c = json.loads((tiny_converted / "config.json").read_text())
    q = c["num_attention_heads"] * c["head_dim"]
    n = (c["num_hidden_layers"] * c["hidden_size"] * (2 * q + 2 * c["num_key_value_heads"] * c["head_dim"]
                                                       + 3 * c["intermediate_size"]) + c["hidden_size"] * c["vocab_size"])
    flops = 4 * n + 12 * c["num_hidden_layers"] * 32 * q
    assert once[0]["mfu"] == pytest.approx(once[0]["tokens_per_s"] * flops / (1e12 * jax.device_count()), rel=1e-9)

    resumed = tmp_path / "resumed"
    run_training(config(tiny_converted, pairs_file, resumed, precompute_reference=True, stop_after=2, **kw))
    capfd.readouterr()
    run_training(config(tiny_converted, pairs_file, resumed, precompute_reference=True, resume=True, **kw))
    err = capfd.readouterr().err
    assert err.count("reference: cache hit") == 2 and "sequences computed" not in err
    assert [r.get("loss") for r in records(resumed)] == [r.get("loss") for r in once]  # bit for bit


@pytest.fixture(scope="module")
def in_step_one_device(tiny_converted, pairs_file, tmp_path_factory):
    return step_on(tiny_converted, pairs_file, tmp_path_factory.mktemp("in-step"), "dp=1,fsdp=1,mp=1",
                   jax.devices()[:1], pack=False)


@pytest.mark.slow
@pytest.mark.parametrize("mesh, kw", [("dp=1,fsdp=4,mp=2", {"grad_accum": 2}),
                                      ("dp=1,fsdp=2,cp=2,mp=2", {"pack": False})])
def test_a_precomputed_reference_gives_the_in_step_loss_and_gradients_on_every_mesh(
        tmp_path, tiny_converted, pairs_file, in_step_one_device, mesh, kw):
    got = step_on(tiny_converted, pairs_file, tmp_path / "precomputed", mesh, jax.devices(),
                  precompute_reference=True, data_cache=str(tmp_path / "cache"), **kw)
    assert_same_step(got, in_step_one_device)


@pytest.mark.slow
def test_the_pairs_held_out_by_eval_fraction_get_their_reference_from_the_same_pass(tmp_path, tiny_converted,
                                                                                     pairs_file, capfd):
    from finetune.train.batches import pair_batch
    from finetune.train.build import setup

    def eval_sums(**kw):
        run = setup(config(tiny_converted, pairs_file, tmp_path / "run", eval_fraction=0.25,
                           data_cache=str(tmp_path / "cache"), **kw))
        with jax.set_mesh(run.mesh):
            return jax.device_get(run.eval_step(run.state.lora, run.frozen,
                                                pair_batch(run.eval_rows, run.batch_sharding, 0, True)))

    in_step = eval_sums()
    capfd.readouterr()
    precomputed = eval_sums(precompute_reference=True)
    assert capfd.readouterr().err.count("sequences computed") == 1  # one pass for both parts of the split
    assert precomputed["pairs"] == in_step["pairs"] == 6
    for name, value in in_step.items():
        assert precomputed[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name


@pytest.mark.slow
def test_a_changed_initial_adapter_gets_its_reference_computed_anew(tmp_path, tiny_converted, pairs_file, capfd):
    from finetune.train.build import setup
    from jaxmodel.formats.peft_adapter import save_peft_adapter

    adapter, cache = tmp_path / "adapter", str(tmp_path / "cache")
    run = setup(config(tiny_converted, pairs_file, tmp_path / "first"))
    for seed in (2, 3):  # the same path, another adapter
        lora = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(seed), x.shape, x.dtype),
                            run.state.lora)
        shutil.rmtree(adapter, ignore_errors=True)
        save_peft_adapter(adapter, lora, run.config.lora_config(), model_config=run.llama, base_model="tiny")
        out = tmp_path / f"dpo-{seed}"
        capfd.readouterr()
        run_training(config(tiny_converted, pairs_file, out, steps=1, init_adapter=str(adapter),
                            precompute_reference=True, data_cache=cache))
        assert "reference: 48 sequences computed" in capfd.readouterr().err
        # the policy starts as its reference, the initial adapter: the first loss is ln 2
        assert records(out)[0]["loss"] == pytest.approx(np.log(2.0), rel=1e-6)


# ---- the cache's key -----------------------------------------------------------------------------------------


@pytest.fixture
def key_inputs(tmp_path, tiny_converted):
    """A copy of the model and an adapter directory (the key reads only their files), and a dpo config on them."""
    model, adapter = tmp_path / "model", tmp_path / "adapter"
    shutil.copytree(tiny_converted, model)
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 8}\n')
    (adapter / "adapter_model.safetensors").write_bytes(b"A" * 64)
    cfg = TrainConfig(model=str(model), data="d", out="o", objective="dpo", init_adapter=str(adapter),
                      reference="init", seq_len=32, dtype="float32").validate()
    return cfg, model, adapter


def _edit_json(path, change) -> None:
    value = json.loads(path.read_text())
    change(value)
    path.write_text(json.dumps(value))


def _other_weights(model, adapter) -> None:  # a weight slice's crc32 differs when its bytes do
    def change(manifest):
        entry = next(iter(manifest["tensors"].values()))
        entry["crc32"] = [c ^ 1 for c in entry["crc32"]]
    _edit_json(model / "jax_checkpoint.json", change)


# part -> (config change, tokens digest change, files change)
CHANGES = {
    "tokens": ({}, "sha256:other", None),
    "seq_len": ({"seq_len": 64}, None, None),
    "model weights": ({}, None, _other_weights),
    "model config": ({}, None, lambda model, adapter: _edit_json(model / "config.json",
                                                                  lambda c: c.update(rms_norm_eps=1e-3))),
    "quantization": ({}, None, lambda model, adapter: _edit_json(
        model / "jax_checkpoint.json", lambda m: m.update(quantization={"scheme": "nf4", "block": 64}))),
    "initial adapter": ({}, None, lambda model, adapter: (adapter / "adapter_model.safetensors").write_bytes(b"B" * 64)),
    "reference": ({"reference": "base"}, None, None),
    "dtype": ({"dtype": "bfloat16"}, None, None),
    "param_dtype": ({"param_dtype": "bfloat16"}, None, None),
}


@pytest.mark.parametrize("part", CHANGES)
def test_stored_values_are_refused_once_any_part_of_their_key_changes(tmp_path, key_inputs, part):
    cfg, model, adapter = key_inputs
    entry = tmp_path / "entry"
    entry.mkdir()
    values = np.arange(6, dtype=np.float32)
    store_reference(entry, reference_key(cfg, "sha256:tokens"), values)
    np.testing.assert_array_equal(load_reference(entry, reference_key(cfg, "sha256:tokens"), 6), values)
    options, digest, change_files = CHANGES[part]
    if change_files:
        change_files(model, adapter)
    changed = reference_key(dataclasses.replace(cfg, **options), digest or "sha256:tokens")
    assert load_reference(entry, changed, 6) is None


def test_the_base_reference_does_not_depend_on_the_initial_adapter(tmp_path, key_inputs):
    cfg, _, adapter = key_inputs
    cfg = dataclasses.replace(cfg, reference="base")
    key = reference_key(cfg, "sha256:tokens")
    (adapter / "adapter_model.safetensors").write_bytes(b"B" * 64)
    assert reference_key(cfg, "sha256:tokens") == key


def test_values_not_stored_whole_are_not_read(tmp_path, key_inputs):
    cfg, _, _ = key_inputs
    entry = tmp_path / "entry"
    entry.mkdir()
    key = reference_key(cfg, "sha256:tokens")
    store_reference(entry, key, np.zeros(6, np.float32))
    assert load_reference(entry, key, 7) is None  # another store's length
    (key_file,) = entry.glob("reference-*.json")
    key_file.unlink()  # a writer that died before the key
    assert load_reference(entry, key, 6) is None


# ---- --plan ---------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_plan_compiles_the_step_without_the_reference_forward(tmp_path):
    from finetune.planning.plan import _compile, plan
    from finetune.step.mesh import make_mesh
    from jaxmodel.config import ModelConfig

    hf = {"model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "torch_dtype": "float32"}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    llama = ModelConfig.from_hf(tmp_path)

    def planned(**kw):
        cfg = TrainConfig(plan=True, model_config=str(tmp_path / "config.json"), mesh="dp=1,fsdp=1,mp=1",
                          seq_len=32, hbm_gb=1, dtype="float32", **kw).validate()
        compiled, _ = _compile(cfg, llama, make_mesh(cfg.mesh, jax.devices()[:1]), np.float32, np.float32)
        return compiled.cost_analysis()["flops"], cfg

    in_step, _ = planned(objective="dpo", batch_size=8)
    precomputed, cfg = planned(objective="dpo", batch_size=8, precompute_reference=True)
    sft, _ = planned(batch_size=16)
    # the reference's forward is a third of a frozen-base LoRA step's work (2N of 6N): it is gone
    assert precomputed < in_step and precomputed <= 1.05 * sft < in_step
    report = str(plan(dataclasses.replace(cfg, mesh="dp=1,fsdp=8,mp=1"), cpu_bf16_figure=False))
    assert "reference base (precomputed before training: no forward in the step)" in report
