"""Context parallelism (`cp`), blockwise attention and the chunked loss in training: the same losses and
LoRA gradients as one device with the plain paths."""

import json
import math
import re

import jax
import numpy as np
import pytest
from flax import nnx

from finetune.cli import main
from finetune.config import TrainConfig
from finetune.data.order import row_indices
from finetune.train.build import setup
from finetune.step.train_step import loss_and_grads
from finetune.train.loop import global_batch
from jaxmodel.context_parallel import cp_order


def test_cp_order_gives_each_device_an_early_and_a_late_chunk():
    order = cp_order(16, 4)  # chunks of 2: device i holds chunks i and 7 - i
    assert order.tolist() == [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]
    assert sorted(order.tolist()) == list(range(16))
    with pytest.raises(ValueError, match="2 x cp = 8"):
        cp_order(12, 4)


def write_packed_data(path):
    """Short documents, packed several to a row of 32, so rows hold document boundaries and padding."""
    rng = np.random.default_rng(0)
    rows = [{"prompt": "please " * int(k) + f"add {a} + {b} =", "completion": f" {a + b}"}
            for a, b, k in rng.integers(0, 5, (48, 3)) * (8, 8, 1)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return write_packed_data(tmp_path_factory.mktemp("data") / "train.jsonl")


def grads_on(tiny_converted, data_file, out, mesh: str, devices, **options):
    config = TrainConfig(model=str(tiny_converted), data=str(data_file), out=str(out), mesh=mesh, steps=1,
                         batch_size=8, seq_len=32, dtype="float32", progress=False, **options).validate()
    run = setup(config, devices=devices)
    # LoRA B made non-zero so that gradients reach A too
    lora = jax.tree.map(lambda x: x + 0.01 * jax.random.normal(jax.random.key(1), x.shape, x.dtype), run.state.lora)
    with jax.set_mesh(run.mesh):
        batch = global_batch(run.train_rows, lambda lo, hi: row_indices(len(run.train_rows), 0, 0, 8, lo, hi),
                             run.batch_sharding, 8)
        assert (np.asarray(batch["segment_ids"]) == 0).any() and np.asarray(batch["segment_ids"]).max() > 1
        fn = jax.jit(lambda lora, base, batch: loss_and_grads(run.graphdef, lora, base, batch,
                                                              loss_chunk=config.loss_chunk))
        loss, tokens, grads = fn(lora, run.base, batch)
    return float(loss), float(tokens), {".".join(map(str, k)): np.asarray(v[...]) for k, v in nnx.to_flat_state(grads)}


@pytest.fixture(scope="module")
def reference(tiny_converted, data_file, tmp_path_factory):
    """One device, plain attention, full logits."""
    return grads_on(tiny_converted, data_file, tmp_path_factory.mktemp("ref"), "dp=1,fsdp=1,mp=1", jax.devices()[:1],
                    attention="xla", loss_chunk=0, mlp_chunk=0)


def assert_same(got, reference, tolerance: float = 1e-5):
    """Equal loss and tokens, and each gradient within `tolerance` of its largest value."""
    loss, tokens, grads = got
    ref_loss, ref_tokens, ref_grads = reference
    assert tokens == ref_tokens and abs(loss - ref_loss) <= tolerance * abs(ref_loss)
    for name, g in grads.items():
        scale = np.abs(ref_grads[name]).max()
        assert scale > 0, name
        np.testing.assert_allclose(g, ref_grads[name], atol=tolerance * scale, rtol=0, err_msg=name)


@pytest.mark.parametrize("mesh, options", [
    ("dp=1,fsdp=1,mp=1", dict(attention="blockwise", loss_chunk=5, mlp_chunk=0)),
    ("dp=1,fsdp=1,mp=1", dict(attention="xla", loss_chunk=0, mlp_chunk=8)),
    ("dp=1,fsdp=2,cp=4,mp=1", dict(attention="blockwise", loss_chunk=3)),
    ("dp=1,fsdp=2,cp=4,mp=1", dict(attention="xla", loss_chunk=0, mlp_chunk=2)),
    ("dp=2,fsdp=1,cp=2,mp=2", dict(attention="auto")),
])
@pytest.mark.slow
def test_same_loss_and_grads_as_one_plain_device(tmp_path, tiny_converted, data_file, reference, mesh, options):
    devices = jax.devices()[:1] if mesh == "dp=1,fsdp=1,mp=1" else jax.devices()
    assert_same(grads_on(tiny_converted, data_file, tmp_path, mesh, devices, **options), reference)


def test_weights_stay_sharded_over_every_device_with_cp(tmp_path, tiny_converted, data_file):
    config = TrainConfig(model=str(tiny_converted), data=str(data_file), out=str(tmp_path), mesh="dp=1,fsdp=2,cp=4,mp=1",
                         batch_size=8, seq_len=32, dtype="float32", progress=False).validate()
    run = setup(config)
    weight = run.model.layers.mlp.up_proj.weight[...]  # [layers, intermediate, hidden]: hidden over fsdp x cp
    assert weight.sharding.spec == jax.sharding.PartitionSpec(None, None, ("fsdp", "cp"))
    assert weight.sharding.shard_shape(weight.shape)[2] == weight.shape[2] // 8


@pytest.mark.e2e
def test_two_processes_with_cp_match_one_device(two_process_grads, data_file, reference):
    assert (two_process_grads / "packed.jsonl").read_bytes() == data_file.read_bytes()
    got = np.load(two_process_grads / "cp.npz")
    assert_same((float(got["loss"]), float(got["tokens"]), {k: got[k] for k in got.files if "." in k}), reference)


@pytest.mark.parametrize("args, message", [
    (["--mesh", "dp=1,fsdp=1,cp=8,mp=1", "--seq-len", "36"],
     "finetune-lora: error: --seq-len 36 must be a multiple of 2 x cp = 16"),
    (["--attention", "flash"], "finetune-lora: error: argument --attention: invalid choice: 'flash'"),
    (["--loss-chunk", "-1"], "finetune-lora: error: --loss-chunk must be 0 or a positive integer, got -1"),
])
def test_bad_long_context_options_are_one_line(tmp_path, tiny_converted, data_file, capsys, args, message):
    try:
        code = main(["--model", str(tiny_converted), "--data", str(data_file), "--out", str(tmp_path / "run"),
                     "--batch-size", "8", "--no-progress", *args])
    except SystemExit as e:  # argparse's own errors
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith(message), err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_under_cp_the_frozen_heads_chunks_hold_device_rows_of_each_devices_own_rows(tmp_path):
    """Each device's part of a sequence is a row of its own (`rows_over_cp`): with cp=8 and one sequence of 8 x 512
    positions, each device holds one row and its chunks of the frozen head's loss hold FROZEN_HEAD_DEVICE_ROWS
    positions. Counted against the whole batch's 8 rows instead, they would hold 512 // 8 = 64."""
    from finetune.planning.plan import _compile
    from finetune.step.mesh import make_mesh
    from jaxmodel.config import ModelConfig
    from jaxmodel.loss import FROZEN_HEAD_DEVICE_ROWS

    vocab = 1000
    hf = {"model_type": "llama", "vocab_size": vocab, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "torch_dtype": "float32"}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    cfg = TrainConfig(plan=True, model_config=str(tmp_path / "config.json"), mesh="dp=1,fsdp=1,cp=8,mp=1",
                      seq_len=8 * 512, batch_size=1, hbm_gb=1, dtype="float32").validate()
    compiled, _ = _compile(cfg, ModelConfig.from_hf(tmp_path), make_mesh(cfg.mesh, jax.devices()), np.float32,
                           np.float32)
    # the head's dots: each device's logits of a chunk, [rows, vocab] or [rows, positions, vocab]
    leading = re.findall(rf"= f32\[([\d,]+),{vocab}\]\S* dot\(", compiled.as_text())
    assert leading and {math.prod(int(d) for d in dims.split(",")) for dims in leading} == {FROZEN_HEAD_DEVICE_ROWS}

