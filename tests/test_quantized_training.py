"""LoRA training on a quantized frozen base (convert-llama --quantize): only LoRA trains, every mesh gives the
same loss and gradients, a resumed run is the uninterrupted one, and --init-adapter starts from an adapter."""

import json
import zlib

import jax
import numpy as np
import pytest
from flax import nnx

from converter import convert
from finetune.cli import main
from finetune.data.order import row_indices
from finetune.run.reading import load_run
from finetune.train.build import setup
from finetune.step.train_step import loss_and_grads
from finetune.train.loop import global_batch, run_training
from jaxmodel import load_pretrained
from jaxmodel.formats.peft_adapter import save_peft_adapter
from jaxmodel.layers import LoRAParam, QuantizedParam
from jaxmodel.lora import LoraConfig, apply_lora
from jaxmodel.quantization import Quantization
from test_finetune import config, flat  # the same run settings as the bf16 equalities


@pytest.fixture(scope="module")
def nf4_converted(tiny_checkpoint, tmp_path_factory):
    """The tiny checkpoint converted with `--quantize nf4` (block 64, the default)."""
    out = tmp_path_factory.mktemp("nf4") / "tiny-nf4"
    convert(tiny_checkpoint, out, quantize="nf4", progress=False)
    return out


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    rng = np.random.default_rng(0)
    rows = [{"prompt": f"add {a} + {b} =", "completion": f" {a + b}"} for a, b in rng.integers(0, 40, (48, 2))]
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def quantized_names(model) -> set[str]:
    return {".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(model, QuantizedParam))}


@pytest.mark.slow
@pytest.mark.parametrize("scheme, block", [("nf4", 64), ("int8", 16), ("fp8", 16)])
def test_only_lora_trains_and_the_codes_and_scales_stay_bit_identical(tmp_path, tiny_checkpoint, nf4_converted,
                                                                    data_file, scheme, block):
    model_dir = nf4_converted if scheme == "nf4" else tmp_path / scheme
    if scheme != "nf4":
        convert(tiny_checkpoint, model_dir, quantize=scheme, quant_block=block, progress=False)
    run = setup(config(model_dir, data_file, tmp_path / "run", steps=20, lr=1e-2, schedule="constant",
                       param_dtype="bfloat16"))
    assert run.model.quantization == Quantization(scheme, block)
    base_before, lora_before = flat(run.base), flat(run.state.lora)
    quantized = quantized_names(run.model)
    assert len(quantized) == 14 and quantized <= set(base_before)  # codes + scales of seven projections
    assert all(k.endswith(("lora_a", "lora_b")) for k in lora_before) and len(lora_before) == 14
    # codes and scales are loaded as stored, whatever --param-dtype does to the other frozen weights
    stored_codes = {"nf4": "uint8", "int8": "int8", "fp8": "uint8"}[scheme]  # FP8 held as its bits
    assert {base_before[k].dtype.name for k in quantized} == {stored_codes, "float32"}
    assert base_before["embed_tokens.weight"].dtype.name == "bfloat16"
    state, losses = run.state, []
    with jax.set_mesh(run.mesh):
        for g in range(20):
            batch = global_batch(run.train_rows, lambda lo, hi, g=g: row_indices(len(run.train_rows), 0, g % 2, 8,
                                                                                    lo, hi), run.batch_sharding, 8)
            state, metrics = run.train_step(state, run.base, batch)
            losses.append(float(metrics["loss"]))
    assert losses[-1] < 0.5 * losses[0]
    for name, value in flat(run.base).items():
        np.testing.assert_array_equal(value, base_before[name], err_msg=name)  # bit-identical
    assert all(not np.array_equal(v, lora_before[k]) for k, v in flat(state.lora).items())
    opt_leaves = jax.tree.leaves(state.opt_state)
    assert sum(x.size for x in opt_leaves) <= 2 * sum(v.size for v in lora_before.values()) + 10


def grads_on(model_dir, data_file, tmp_path, mesh: str, devices):
    run = setup(config(model_dir, data_file, tmp_path / "run", mesh=mesh), devices=devices)
    lora = jax.tree.map(lambda x: x + 0.01 * jax.random.normal(jax.random.key(1), x.shape, x.dtype), run.state.lora)
    with jax.set_mesh(run.mesh):
        batch = global_batch(run.train_rows, lambda lo, hi: row_indices(len(run.train_rows), 0, 0, 8, lo, hi),
                             run.batch_sharding, 8)
        fn = jax.jit(lambda lora, base, batch: loss_and_grads(run.graphdef, lora, base, batch, 1))
        loss, tokens, grads = fn(lora, run.base, batch)
    return float(loss), float(tokens), flat(grads)


@pytest.fixture(scope="module")
def reference_grads(nf4_converted, data_file, tmp_path_factory):
    return grads_on(nf4_converted, data_file, tmp_path_factory.mktemp("ref"), "dp=1,fsdp=1,mp=1", jax.devices()[:1])


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["dp=1,fsdp=8,mp=1", "dp=2,fsdp=2,mp=2"])
def test_same_loss_and_grads_on_every_mesh(tmp_path, nf4_converted, data_file, reference_grads, mesh):
    """As for an unquantized base (tests/test_finetune.py), to the same tolerance."""
    loss, tokens, grads = grads_on(nf4_converted, data_file, tmp_path, mesh, jax.devices())
    ref_loss, ref_tokens, ref_grads = reference_grads
    assert tokens == ref_tokens and abs(loss - ref_loss) <= 1e-5
    for name, g in grads.items():
        np.testing.assert_allclose(g, ref_grads[name], atol=1e-5, rtol=0, err_msg=name)


@pytest.mark.slow
def test_fp8_codes_split_at_whole_blocks_give_the_one_device_loss_and_grads(tmp_path, tiny_checkpoint, data_file):
    fp8 = tmp_path / "fp8"
    convert(tiny_checkpoint, fp8, quantize="fp8", quant_block=8, progress=False)
    run = setup(config(fp8, data_file, tmp_path / "probe", mesh="dp=2,fsdp=2,mp=2"), devices=jax.devices())
    split = [v.sharding.spec for p, v in nnx.to_flat_state(run.base) if p[-1] == "codes"]
    assert any(any(axis is not None for axis in spec) for spec in split)  # some codes do lie split
    loss, tokens, grads = grads_on(fp8, data_file, tmp_path / "mesh", "dp=2,fsdp=2,mp=2", jax.devices())
    ref_loss, ref_tokens, ref_grads = grads_on(fp8, data_file, tmp_path / "one", "dp=1,fsdp=1,mp=1", jax.devices()[:1])
    assert tokens == ref_tokens and abs(loss - ref_loss) <= 1e-5
    for name, g in grads.items():
        np.testing.assert_allclose(g, ref_grads[name], atol=1e-5, rtol=0, err_msg=name)


@pytest.mark.slow
def test_a_run_multiplying_in_fp8_takes_an_fp8_base(tmp_path, nf4_converted, data_file, capsys):
    """finetune-lora --fp8-matmul on an NF4 base: one line, exit 2, no run directory."""
    out = tmp_path / "run"
    assert main(["--model", str(nf4_converted), "--data", str(data_file), "--out", str(out), "--steps", "1",
                 "--fp8-matmul", "e4m3fnuz", "--no-progress"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "finetune-lora: error: --fp8-matmul e4m3fnuz: the base is quantized nf4; FP8 matmuls take an fp8 base (an FP8 "
        "checkpoint, or convert-llama --quantize fp8)")
    assert not out.exists()


# Dropout and gradient accumulation on, codes split over fsdp and mp: as tests/test_finetune.py's resume test.
RESUMED = {"steps": 4, "lora_dropout": 0.1, "grad_accum": 2, "mesh": "dp=1,fsdp=4,mp=2", "targets": "q_proj,v_proj",
           "remat": "none"}


@pytest.mark.slow
def test_resume_on_a_quantized_base_continues_exactly(tmp_path, nf4_converted, data_file, monkeypatch):
    """Four steps in one go == two steps, a checkpoint, and `resume=True` for the other two, bit for bit."""
    import finetune.train.loop

    monkeypatch.setattr(finetune.train.loop, "measure_peak_flops", lambda dtype: 1e12)
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    run_training(config(nf4_converted, data_file, whole, **RESUMED))
    run_training(config(nf4_converted, data_file, resumed, stop_after=2, **RESUMED))
    run_training(config(nf4_converted, data_file, resumed, resume=True, **RESUMED))
    a = [json.loads(line) for line in (whole / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(line) for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    (lora_a, _, step_a), (lora_b, _, step_b) = load_run(whole), load_run(resumed)
    assert step_a == step_b == 4
    for name, value in flat(lora_a).items():
        np.testing.assert_array_equal(value, flat(lora_b)[name], err_msg=name)


@pytest.mark.slow
def test_init_adapter_on_a_quantized_base_starts_from_the_adapter(tmp_path, nf4_converted, data_file):
    """The run's LoRA state at step 0 is the adapter's (with its own rank and targets), and the CLI's first
    loss is that of the adapter on the run's first batch."""
    lora_config = LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "down_proj"))
    model = apply_lora(load_pretrained(nf4_converted), lora_config, rngs=nnx.Rngs(3))
    for path, var in nnx.to_flat_state(nnx.state(model, LoRAParam)):
        if path[-1] == "lora_b":  # non-zero B, one key per module, so the adapter moves the output
            key = jax.random.key(zlib.crc32(".".join(map(str, path)).encode()))
            var.set_value(0.05 * jax.random.normal(key, var[...].shape))
    adapter = save_peft_adapter(tmp_path / "adapter", nnx.state(model, LoRAParam), lora_config,
                                model_config=model.config, base_model="x")
    run = setup(config(nf4_converted, data_file, tmp_path / "run", init_adapter=str(adapter), rank=16))
    assert (run.config.rank, run.config.target_modules) == (4, ("down_proj", "q_proj"))
    want = flat(nnx.state(model, LoRAParam))
    got = flat(run.state.lora)
    assert set(got) == set(want)
    for name, value in got.items():
        np.testing.assert_array_equal(value, want[name], err_msg=name)
    with jax.set_mesh(run.mesh):  # the loss of the run's first batch with the adapter as it was saved
        batch = global_batch(run.train_rows, lambda lo, hi: row_indices(len(run.train_rows), 0, 0, 8, lo, hi),
                             run.batch_sharding, 8)
        want_loss = float(jax.jit(lambda lora, base, batch: loss_and_grads(run.graphdef, lora, base, batch, 1)[0])(
            run.state.lora, run.base, batch))
    code = main(["--model", str(nf4_converted), "--data", str(data_file), "--out", str(tmp_path / "cli"),
                 "--init-adapter", str(adapter), "--steps", "2", "--batch-size", "8", "--seq-len", "32",
                 "--dtype", "float32", "--no-progress"])
    assert code == 0
    first = json.loads((tmp_path / "cli" / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    assert first == pytest.approx(want_loss, rel=1e-6)
