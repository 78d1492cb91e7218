"""convert-llama --quantize: the stored codes are bitsandbytes', the loaded model is the in-memory quantized
one (also sharded), verification covers the codes, and bad input is refused before anything is written."""

import json
import shutil

import bitsandbytes.functional as bnb
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P
from safetensors.numpy import load_file

from converter import ConversionError, convert, verify
from converter.cli import main
from demo.tiny import build_tiny_model
from jaxmodel import load_pretrained
from jaxmodel.formats.checkpoint import MANIFEST, CheckpointError, read_manifest
from jaxmodel.layers import QuantizedParam
from jaxmodel.model import quantize_model
from jaxmodel.quantization import Quantization

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
SMALL = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 8}
IDS = jnp.asarray(np.random.default_rng(0).integers(0, 512, (2, 9)), jnp.int32)


@pytest.fixture(scope="module")
def nf4_converted(tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("nf4") / "tiny-nf4"
    convert(tiny_checkpoint, out, quantize="nf4", quant_block=8, progress=False)
    return out


def flat_state(model) -> dict[str, np.ndarray]:
    return {".".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def test_manifest_and_stored_codes_are_bitsandbytes(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "nf4"
    assert main(["--src", str(tiny_checkpoint), "--out", str(out), "--quantize", "nf4", "--no-progress"]) == 0
    assert "converted" in capsys.readouterr().out
    manifest = read_manifest(out)
    assert manifest["version"] == 2 and manifest["quantization"] == {"scheme": "nf4", "block": 64}  # the default
    tensors = manifest["tensors"]
    for module in PROJECTIONS:
        assert f"layers.{module}.weight" not in tensors
        codes, scales = tensors[f"layers.{module}.codes"], tensors[f"layers.{module}.scales"]
        assert codes["dtype"] == "uint8" and scales["dtype"] == "float32"
        assert codes["stacked"] and len(codes["crc32"]) == 2 and len(scales["crc32"]) == 2
    assert tensors["lm_head.weight"]["dtype"] == "float32" and "embed_tokens.weight" in tensors
    # the bytes on disk, read with the safetensors package, are bitsandbytes' quantize_4bit of the HF tensor
    hf = {}
    for file in sorted(tiny_checkpoint.glob("model-*.safetensors")):
        hf.update(load_file(file))
    stored = load_file(out / "params" / "layers.mlp.down_proj.codes.safetensors")
    absmax = load_file(out / "params" / "layers.mlp.down_proj.scales.safetensors")
    for layer in range(2):
        w = torch.from_numpy(hf[f"model.layers.{layer}.mlp.down_proj.weight"])
        packed, state = bnb.quantize_4bit(w, quant_type="nf4", blocksize=64)
        np.testing.assert_array_equal(stored["layers.mlp.down_proj.codes"][layer].reshape(-1), packed.numpy().reshape(-1))
        np.testing.assert_array_equal(absmax["layers.mlp.down_proj.scales"][layer].reshape(-1), state.absmax.numpy())
    assert verify(out) > 0


@pytest.mark.slow
@pytest.mark.parametrize("scheme, block", [("nf4", 8), ("int8", 16)])
def test_converted_quantized_loads_as_the_in_memory_quantized_model(tiny_checkpoint, tiny_converted, nf4_converted,
                                                                     tmp_path, scheme, block):
    out = nf4_converted if (scheme, block) == ("nf4", 8) else tmp_path / "q"
    if out != nf4_converted:
        convert(tiny_checkpoint, out, quantize=scheme, quant_block=block, progress=False)
    loaded = load_pretrained(out)
    assert loaded.quantization == Quantization(scheme, block)
    expected = quantize_model(load_pretrained(tiny_converted), Quantization(scheme, block))
    got, want = flat_state(loaded), flat_state(expected)
    assert set(got) == set(want)
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    np.testing.assert_array_equal(np.asarray(loaded(IDS)), np.asarray(expected(IDS)))


def test_param_dtype_casts_only_the_unquantized_parameters(nf4_converted):
    model = load_pretrained(nf4_converted, param_dtype=jnp.bfloat16)
    assert model.embed_tokens.weight[...].dtype == jnp.bfloat16 and model.dtype == jnp.bfloat16
    assert model.layers.self_attn.q_proj.codes[...].dtype == jnp.uint8
    assert model.layers.self_attn.q_proj.scales[...].dtype == jnp.float32


def test_small_chunks_store_the_same_bytes(tiny_checkpoint, nf4_converted, tmp_path, monkeypatch):
    """Chunks that end inside a block (the carry between chunks) give the same codes as whole tensors."""
    import jaxmodel.formats.hf_checkpoint as hf_checkpoint

    monkeypatch.setattr(hf_checkpoint, "CHUNK_BYTES", 4 * 13)  # 13 float32 values: never a whole block of 8
    convert(tiny_checkpoint, tmp_path / "small", quantize="nf4", quant_block=8, progress=False)
    for file in (nf4_converted / "params").iterdir():
        assert (tmp_path / "small" / "params" / file.name).read_bytes() == file.read_bytes(), file.name
    assert (tmp_path / "small" / MANIFEST).read_bytes() == (nf4_converted / MANIFEST).read_bytes()


def test_verify_detects_a_flipped_byte_in_codes(nf4_converted, tmp_path):
    copy = shutil.copytree(nf4_converted, tmp_path / "copy")
    file = copy / "params" / "layers.self_attn.v_proj.codes.safetensors"
    data = bytearray(file.read_bytes())
    data[-3] ^= 0x10  # a code in the last layer's slice
    file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"checksum mismatch in 'layers.self_attn.v_proj.codes' layer 1"):
        verify(copy)


def test_sharded_load_equals_unsharded(nf4_converted):
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(1, 8, 1, 1), ("dp", "fsdp", "cp", "mp"))
    with jax.set_mesh(mesh):
        sharded = load_pretrained(nf4_converted, mesh=mesh)
        logits = np.asarray(jax.jit(lambda m, ids: m(ids))(sharded, IDS))
    plain = load_pretrained(nf4_converted)
    got, want = flat_state(sharded), flat_state(plain)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    np.testing.assert_allclose(logits, np.asarray(plain(IDS)), rtol=0, atol=1e-5 * np.abs(logits).max())
    q = sharded.layers.self_attn.q_proj  # [64 out, 64 in]: 8 blocks of 8, one per device
    assert q.codes[...].sharding.spec == P(None, None, "fsdp", None) and q.scales[...].sharding.spec == P(None, None, "fsdp")
    shard = q.codes[...].addressable_shards[0].data
    assert shard.shape == (2, 64, 1, 4)  # whole blocks per device
    down = sharded.layers.mlp.down_proj  # [64 out, 128 in]: out over fsdp, 16 blocks whole per row
    assert down.codes[...].sharding.spec == P(None, "fsdp", None, None)


def test_sharded_load_keeps_blocks_whole_when_they_do_not_divide(tiny_checkpoint, tmp_path):
    convert(tiny_checkpoint, tmp_path / "q16", quantize="nf4", quant_block=16, progress=False)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(1, 8, 1, 1), ("dp", "fsdp", "cp", "mp"))
    with jax.set_mesh(mesh):
        model = load_pretrained(tmp_path / "q16", mesh=mesh)
    q = model.layers.self_attn.q_proj  # 64 in = 4 blocks of 16: not over 8 devices, though its 32 bytes would be
    assert all(axis is None for v in (q.codes, q.scales) for axis in v[...].sharding.spec)
    plain = load_pretrained(tmp_path / "q16")
    np.testing.assert_array_equal(np.asarray(q.codes[...]), np.asarray(plain.layers.self_attn.q_proj.codes[...]))


def test_unquantized_checkpoints_stay_version_1(tiny_converted):
    manifest = read_manifest(tiny_converted)
    assert manifest["version"] == 1 and "quantization" not in manifest
    assert all(isinstance(v, QuantizedParam) is False for v in jax.tree.leaves(
        nnx.state(load_pretrained(tiny_converted)), is_leaf=lambda x: isinstance(x, nnx.Variable)))


@pytest.mark.parametrize("edit, needle", [
    (lambda m: {**m, "quantization": {"scheme": "nf3", "block": 8}}, "'quantization': quantization scheme 'nf3'"),
    (lambda m: {**m, "quantization": {"scheme": "nf4"}}, "'quantization' should be"),
    (lambda m: {**m, "version": 1}, "'quantization' needs version 2"),
    (lambda m: {k: v for k, v in m.items() if k != "quantization"}, "'quantization' should be"),
    (lambda m: {**m, "quantization": {"scheme": "nf4", "block": 48}}, "does not fit config.json"),
])
def test_malformed_quantization_in_manifest(nf4_converted, tmp_path, edit, needle):
    copy = shutil.copytree(nf4_converted, tmp_path / "copy")
    manifest = json.loads((copy / MANIFEST).read_text())
    (copy / MANIFEST).write_text(json.dumps(edit(manifest)))
    with pytest.raises(CheckpointError, match=needle) as info:
        load_pretrained(copy)
    assert str(copy / MANIFEST) in str(info.value)


# --- bad input -----------------------------------------------------------------------------------------------

def run(capsys, *args) -> tuple[int, str]:
    code = main([*args, "--no-progress"])
    return code, capsys.readouterr().err


def assert_refused(code: int, err: str, tmp_path, *needles: str, exit_code: int = 1) -> None:
    lines = err.strip().splitlines()
    assert code == exit_code and len(lines) == 1 and lines[0].startswith("convert-llama: error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert [p.name for p in tmp_path.iterdir() if p.name not in ("src", "jax")] == []


def test_block_that_does_not_divide_an_input_dimension(capsys, tmp_path):
    src = build_tiny_model(tmp_path / "src", {**SMALL, "intermediate_size": 48}, tokenizer=False)
    capsys.readouterr()  # transformers' progress bar
    code, err = run(capsys, "--src", str(src), "--out", str(tmp_path / "out"), "--quantize", "nf4",
                    "--quant-block", "32")  # divides hidden 32, not intermediate 48
    assert_refused(code, err, tmp_path, "--quant-block 32", "input dimension 48",
                   "'model.layers.0.mlp.down_proj.weight'")


def test_quant_block_without_quantize(capsys, tmp_path, tiny_checkpoint):
    code, err = run(capsys, "--src", str(tiny_checkpoint), "--out", str(tmp_path / "out"), "--quant-block", "32")
    assert_refused(code, err, tmp_path, "--quant-block needs --quantize", exit_code=2)


def test_odd_block_for_nf4(capsys, tmp_path, tiny_checkpoint):
    code, err = run(capsys, "--src", str(tiny_checkpoint), "--out", str(tmp_path / "out"), "--quantize", "nf4",
                    "--quant-block", "7")
    assert_refused(code, err, tmp_path, "--quant-block 7", "even", exit_code=2)


@pytest.mark.parametrize("quantize", [[], ["--quantize", "int8"]])
def test_hf_source_that_is_already_quantized(capsys, tmp_path, tiny_checkpoint, quantize):
    src = shutil.copytree(tiny_checkpoint, tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (src / "config.json").write_text(json.dumps(config))
    code, err = run(capsys, "--src", str(src), "--out", str(tmp_path / "out"), *quantize)
    assert_refused(code, err, tmp_path, "config.json", "'quantization_config' (bitsandbytes)", "already quantized")


def test_converted_checkpoint_as_source(capsys, tmp_path, nf4_converted):
    code, err = run(capsys, "--src", str(nf4_converted), "--out", str(tmp_path / "out"), "--quantize", "nf4")
    assert_refused(code, err, tmp_path, f"--src {nf4_converted}", "a converted checkpoint")


def test_convert_checks_options_before_reading(tiny_checkpoint, tmp_path):
    with pytest.raises(ConversionError, match="--quantize 'int4'"):
        convert(tiny_checkpoint, tmp_path / "out", quantize="int4")
    assert not (tmp_path / "out").exists()
