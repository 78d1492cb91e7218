"""An FP8 frozen base (DeepSeek-V3's hub layout: e4m3 codes, one float32 scale per block x block block, partial blocks
at the edges): quantized as transformers' `Fp8Quantize` quantizes, dequantized as its `Fp8Dequantize` does, a model
on it computing exactly "dequantize, then the usual layer", sharded at whole blocks."""

import types

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P
from transformers.integrations.finegrained_fp8 import Fp8Dequantize, Fp8Quantize

from jaxmodel import CausalLM, ModelConfig
from jaxmodel.layers import QuantizedParam
from jaxmodel.model import quantize_model
from jaxmodel.quantization import Quantization, dequantize, dequantize_numpy, fnuz_codes, quantize
from jaxmodel.sharding import variable_sharding

# A DeepSeek-V3 on 4 x 4 blocks: kv_a_proj_with_mqa's 10 rows end in a partial block, as the hub's 576 do at 128.
DEEPSEEK = {"model_type": "deepseek_v3", "vocab_size": 40, "hidden_size": 16, "intermediate_size": 24,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 8,
            "kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 2, "v_head_dim": 4,
            "first_k_dense_replace": 1, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 2,
            "topk_group": 1, "moe_intermediate_size": 8, "n_shared_experts": 1, "max_position_embeddings": 64,
            "initializer_range": 0.1}
IDS = jnp.asarray(np.random.default_rng(0).integers(0, 40, (2, 7)), jnp.int32)


def transformers_fp8(w: np.ndarray, block: int, scale_fmt: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """transformers' codes (as uint8 bits) and scales of `w`, zero-padded to whole blocks and cropped back (its
    quantizer leaves a weight with partial blocks unquantized; zeros change no block's absmax); with `scale_fmt`
    "ue8m0" (DeepSeek-V3.1's) the scales are powers of two, a torch float8_e8m0fnu tensor."""
    *lead, out, cols = w.shape
    rows_p, cols_p = -(-out // block) * block, -(-cols // block) * block
    padded = np.zeros((*lead, rows_p, cols_p), np.float32)
    padded[..., :out, :cols] = w
    config = types.SimpleNamespace(weight_block_size=(block, block), scale_fmt=scale_fmt)
    found = Fp8Quantize(types.SimpleNamespace(quantization_config=config))._quantize_one(
        "w.weight", torch.from_numpy(padded))
    codes = found["w.weight"].view(torch.uint8).numpy()[..., :out, :cols]
    scales = found["w.weight_scale_inv"]
    return codes, scales if scale_fmt else scales.numpy()


def weights(shape, seed=0) -> np.ndarray:
    """Normal values over magnitudes 1e-3 to 1e3, so blocks' scales differ by orders of magnitude, and a zero block."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape) * 10.0 ** rng.integers(-3, 4, shape)
    w[..., :2, :2] = 0
    return w.astype(np.float32)


@pytest.mark.parametrize("shape, block", [((8, 12), 4), ((3, 10, 7), 4), ((130, 260), 128), ((5, 3), 8)])
def test_codes_and_scales_are_transformers_fp8(shape, block):
    w = weights(shape)
    codes, scales = quantize(w, Quantization("fp8", block))
    want_codes, want_scales = transformers_fp8(w, block)
    assert codes.dtype == ml_dtypes.float8_e4m3fn and codes.shape == w.shape
    assert scales.dtype == np.float32 and scales.shape == (*shape[:-2], -(-shape[-2] // block), -(-shape[-1] // block))
    np.testing.assert_array_equal(codes.view(np.uint8), want_codes)
    np.testing.assert_array_equal(scales.view(np.uint32), want_scales.view(np.uint32))
    assert np.isfinite(codes.astype(np.float32)).all()  # clamped before the cast: no NaN codes


@pytest.mark.parametrize("shape, block", [((8, 12), 4), ((3, 10, 7), 4)])
def test_dequantized_as_transformers_dequantizes(shape, block):
    quantization = Quantization("fp8", block)
    codes, scales = quantize(weights(shape, 1), quantization)
    # transformers dequantizes whole blocks only: its reference is the zero-padded weight's, cropped
    *lead, out, cols = shape
    padded_codes = np.zeros((*lead, -(-out // block) * block, -(-cols // block) * block), codes.dtype)
    padded_codes[..., :out, :cols] = codes
    want = Fp8Dequantize(None)._dequantize_one(torch.from_numpy(padded_codes.view(np.uint8)).view(torch.float8_e4m3fn),
                                               torch.from_numpy(scales), torch.float32).numpy()[..., :out, :cols]
    np.testing.assert_array_equal(dequantize_numpy(codes, scales, quantization), want)
    np.testing.assert_array_equal(np.asarray(jax.jit(dequantize, static_argnums=2)(codes, scales, quantization)), want)


def test_nonfinite_weights_are_refused():
    with pytest.raises(ValueError, match="NaN or infinite"):
        quantize(np.array([[1.0, np.inf]], np.float32), Quantization("fp8", 2))


def test_fnuz_codes_keep_every_finite_value():
    """MI300X's e4m3fnuz: every finite e4m3fn code (all 254 of them, both zeros) times its scale equals its fnuz code
    times the fnuz scale, in float64 by ml_dtypes' own casts; a weight quantized with partial blocks dequantizes to the
    same float32 values; NaN codes are refused."""
    bits = np.arange(256, dtype=np.uint8).reshape(16, 16)
    finite = ~np.isnan(bits.view(ml_dtypes.float8_e4m3fn).astype(np.float64))
    scales = np.float32([[0.75, 3.0], [2.0**-20, 2.0**40]])  # 8 x 8 blocks
    codes, fnuz_scales = fnuz_codes(np.where(finite, bits, 0), scales)
    assert codes.dtype == ml_dtypes.float8_e4m3fnuz and fnuz_scales.dtype == np.float32
    per_value = np.repeat(np.repeat(scales, 8, 0), 8, 1).astype(np.float64)
    fnuz_per_value = np.repeat(np.repeat(fnuz_scales, 8, 0), 8, 1).astype(np.float64)
    want = bits.view(ml_dtypes.float8_e4m3fn).astype(np.float64) * per_value
    got = codes.astype(np.float64) * fnuz_per_value
    np.testing.assert_array_equal(got[finite], want[finite])
    assert not np.isnan(got).any() and codes.view(np.uint8)[8, 0] == 0  # -0 (0x80) became 0
    assert bits[7, 14] == 0x7E and got[7, 14] == 448.0 * 3.0  # e4m3fn's largest, past e4m3fnuz's 240
    quantization = Quantization("fp8", 4)
    w_codes, w_scales = quantize(weights((10, 7)), quantization)
    np.testing.assert_array_equal(dequantize_numpy(w_codes, w_scales, quantization),
                                  _blockwise(*fnuz_codes(w_codes, w_scales), 4))
    with pytest.raises(ValueError, match="2 fp8 codes are NaN"):
        fnuz_codes(bits, scales)


def _blockwise(codes, scales, block):
    """float32 `codes * scale`, each scale over its block (an independent reading of the layout)."""
    out, cols = codes.shape
    scale = np.repeat(np.repeat(scales, block, 0), block, 1)[:out, :cols]
    return codes.astype(np.float32) * scale


@pytest.mark.slow
def test_fp8_deepseek_is_the_dequantized_model():
    plain = CausalLM(ModelConfig.from_hf(DEEPSEEK), rngs=nnx.Rngs(0))
    model = quantize_model(plain, Quantization("fp8", 4))
    quantized = {".".join(map(str, p)) for p, v in nnx.to_flat_state(nnx.state(model, QuantizedParam))}
    # every Linear of the decoder, the routed and shared experts included; not the router, embeddings or head
    assert {n.rsplit(".", 2)[-2] for n in quantized} == {
        "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
        "gate_up_proj"}
    assert not any(".gate." in n or n.startswith(("embed", "lm_head")) for n in quantized)
    kv_a = model.layers.self_attn.kv_a_proj_with_mqa
    assert kv_a.codes[...].shape == (1, 10, 16) and kv_a.scales[...].shape == (1, 3, 4)
    from test_quantization import dequantized_reference

    got, want = np.asarray(model(IDS)), np.asarray(dequantized_reference(model)(IDS))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    assert np.abs(got - np.asarray(plain(IDS))).max() > 1e-5  # quantization did change the weights


def test_codes_and_scales_split_at_whole_blocks():
    """A split of `out` or `in` falls on block edges for codes and scales alike; a dimension ending in a partial
    block stays whole, though its rows and its scales would both split evenly (out of step)."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(1, 4, 1, 2), ("dp", "fsdp", "cp", "mp"))
    config = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=6)
    model = nnx.eval_shape(lambda: CausalLM(config, quantization=Quantization("fp8", 16), rngs=nnx.Rngs(0)))

    def specs(linear):
        return tuple(variable_sharding(v, mesh).spec for v in (linear.codes, linear.scales))

    # gate_proj [32 out (mlp), 64 in (embed)]: 2 blocks of the output over mp=2, 4 of the input over fsdp=4
    assert specs(model.layers.mlp.gate_proj) == (P(None, "mp", "fsdp"), P(None, "mp", "fsdp"))
    # q_proj [24 out (heads), 64 in]: 24 rows and 2 scales would split over mp, 12 rows apiece across a block's edge
    assert specs(model.layers.self_attn.q_proj) == (P(None, None, "fsdp"), P(None, None, "fsdp"))
    # o_proj [64 out (embed), 24 in (heads)]: the output's 4 blocks over fsdp, the partial input whole
    assert specs(model.layers.self_attn.o_proj) == (P(None, "fsdp", None), P(None, "fsdp", None))


# ---- conversion: an FP8 checkpoint kept as it is, --quantize fp8, the multi-token-prediction layer skipped ----

def is_fp8_projection(name: str) -> bool:
    """Whether the hub's FP8 checkpoints store HF tensor `name` in FP8: every Linear weight of the decoder but the
    routers'."""
    return name.startswith("model.layers.") and name.endswith("proj.weight") or name.endswith("mqa.weight")


def write_fp8_checkpoint(hf_dir, out, block: int, mtp: bool = True, scale_fmt: str | None = None) -> dict:
    """The FP8 checkpoint of the unquantized one at `hf_dir`, made by transformers' quantizer, in DeepSeek-V3's hub
    layout (codes `weight` and float32 `weight_scale_inv`, `quantization_config`), with a multi-token-prediction
    layer past num_hidden_layers as the hub's have; returns its tensors."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    out.mkdir()
    source = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        source.update(load_file(file))
    tensors = {}
    for name, t in source.items():
        if not is_fp8_projection(name):
            tensors[name] = t
            continue
        codes, scales = transformers_fp8(t.float().numpy(), block, scale_fmt)
        tensors[name] = torch.from_numpy(codes).view(torch.float8_e4m3fn)
        tensors[name.removesuffix("weight") + "weight_scale_inv"] = scales if scale_fmt else torch.from_numpy(scales)
    config = json.loads((hf_dir / "config.json").read_text())
    if mtp:  # layer L: its own norms and projections, FP8 too
        layer = config["num_hidden_layers"]
        tensors[f"model.layers.{layer}.enorm.weight"] = torch.ones(config["hidden_size"])
        tensors[f"model.layers.{layer}.eh_proj.weight"] = torch.zeros(4, 4, dtype=torch.float8_e4m3fn)
        tensors[f"model.layers.{layer}.eh_proj.weight_scale_inv"] = torch.ones(1, 1)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [block, block], **({"scale_fmt": scale_fmt} if scale_fmt
                                                                             else {})}
    (out / "config.json").write_text(json.dumps(config))
    for aux in ("generation_config.json",):
        if (hf_dir / aux).is_file():
            shutil.copy(hf_dir / aux, out / aux)
    return tensors


@pytest.fixture(scope="module")
def deepseek_checkpoints(tmp_path_factory):
    """A tiny DeepSeek-V3 in float32 (transformers' save_pretrained) and its FP8 checkpoint in blocks of 4."""
    from test_deepseek import deepseek_model

    root = tmp_path_factory.mktemp("deepseek-fp8")
    hf = deepseek_model(DEEPSEEK)
    hf.save_pretrained(root / "hf")
    tensors = write_fp8_checkpoint(root / "hf", root / "fp8", block=4)
    return root, hf, tensors


def stored(directory, path: str) -> np.ndarray:
    from jaxmodel.formats.checkpoint import open_tensor, read_manifest

    return np.asarray(open_tensor(directory, path, read_manifest(directory)["tensors"][path]))


@pytest.mark.slow
def test_an_fp8_checkpoint_converts_as_it_is_and_computes_as_transformers_on_its_dequantized_weights(
        deepseek_checkpoints, tmp_path, capsys):
    from converter.cli import main
    from jaxmodel import load_pretrained
    from jaxmodel.formats.checkpoint import read_manifest

    root, _, tensors = deepseek_checkpoints
    assert main(["--src", str(root / "fp8"), "--out", str(tmp_path / "jax"), "--no-progress", "--verify"]) == 0
    said = capsys.readouterr().out
    assert "skipped the 3 tensors of the multi-token-prediction layers past num_hidden_layers" in said
    manifest = read_manifest(tmp_path / "jax")
    assert manifest["quantization"] == {"scheme": "fp8", "block": 4}
    # byte copies: the q_a_proj of both layers, an expert's gate and up rows within the fused gate_up
    codes = stored(tmp_path / "jax", "layers.self_attn.q_a_proj.codes")
    assert codes.dtype == ml_dtypes.float8_e4m3fn
    np.testing.assert_array_equal(codes[0].view(np.uint8),
                                  tensors["model.layers.0.self_attn.q_a_proj.weight"].view(torch.uint8).numpy())
    gate_up = stored(tmp_path / "jax", "moe_layers.mlp.experts.gate_up_proj.codes")
    up = tensors["model.layers.1.mlp.experts.2.up_proj.weight"].view(torch.uint8).numpy()
    np.testing.assert_array_equal(gate_up[0, 2, 8:].view(np.uint8), up)
    scales = stored(tmp_path / "jax", "moe_layers.mlp.experts.gate_up_proj.scales")
    np.testing.assert_array_equal(scales[0, 2, 2:], tensors["model.layers.1.mlp.experts.2.up_proj.weight_scale_inv"])
    # the reference: transformers' class on the float32 weights dequantized by hand (torch, not this port)
    reference = dequantized_by_hand(root / "hf", tensors, 4, tmp_path / "reference")
    from test_parity import f32_tolerance, hf_logits, jax_logits

    ids = np.random.default_rng(1).integers(0, DEEPSEEK["vocab_size"], (2, 9))
    expected = hf_logits(reference, ids)
    assert np.abs(np.asarray(jax_logits(load_pretrained(tmp_path / "jax"), jnp.asarray(ids, jnp.int32))) -
                  expected).max() <= f32_tolerance(expected)


def dequantized_by_hand(hf_dir, tensors: dict, block: int, out):
    """transformers' DeepseekV3ForCausalLM loaded from the FP8 `tensors` dequantized in torch (float32), the
    multi-token-prediction layer left out."""
    import shutil

    from safetensors.torch import save_file
    from transformers import DeepseekV3ForCausalLM

    out.mkdir()
    state = {}
    for name, t in tensors.items():
        if name.endswith("weight_scale_inv") or name.startswith(f"model.layers.{DEEPSEEK['num_hidden_layers']}."):
            continue
        if t.dtype == torch.float8_e4m3fn:
            rows, cols = t.shape
            scale = tensors[name + "_scale_inv"].repeat_interleave(block, 0).repeat_interleave(block, 1)
            t = t.float() * scale[:rows, :cols]
        state[name] = t
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(hf_dir / "config.json", out / "config.json")
    model = DeepseekV3ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    model.set_experts_implementation("eager")
    return model


@pytest.mark.slow
def test_quantize_fp8_stores_what_transformers_quantizer_stores(deepseek_checkpoints, tmp_path, monkeypatch):
    """`--quantize fp8` on the float32 checkpoint stores the bytes of the FP8 one transformers' quantizer made, in
    chunks that end inside rows and blocks too."""
    import jaxmodel.formats.hf_checkpoint as hf_checkpoint
    from converter import convert

    root, _, _ = deepseek_checkpoints
    convert(root / "fp8", tmp_path / "kept", progress=False)
    monkeypatch.setattr(hf_checkpoint, "CHUNK_BYTES", 4 * 13)
    convert(root / "hf", tmp_path / "quantized", quantize="fp8", quant_block=4, progress=False)
    files = sorted(f.name for f in (tmp_path / "kept" / "params").iterdir())
    assert files == sorted(f.name for f in (tmp_path / "quantized" / "params").iterdir())
    assert any(".codes" in f for f in files)
    for name in files:
        assert (tmp_path / "quantized" / "params" / name).read_bytes() == \
            (tmp_path / "kept" / "params" / name).read_bytes(), name


@pytest.mark.slow
def test_power_of_two_scales_stored_as_e8m0_convert_to_their_float32_values(deepseek_checkpoints, tmp_path):
    """DeepSeek-V3.1's scale format (`scale_fmt` "ue8m0"), its scales as transformers writes them: float8_e8m0fnu
    tensors, read as the float32 powers of two they are."""
    from converter import convert

    root, _, _ = deepseek_checkpoints
    tensors = write_fp8_checkpoint(root / "hf", tmp_path / "ue8m0", block=4, scale_fmt="ue8m0")
    scales = tensors["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"]
    assert scales.dtype == torch.float8_e8m0fnu
    convert(tmp_path / "ue8m0", tmp_path / "jax", progress=False)
    got = stored(tmp_path / "jax", "layers.self_attn.kv_a_proj_with_mqa.scales")[0]
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, scales.float().numpy())
    assert set(np.log2(got).reshape(-1) % 1) == {0.0}


def edited_fp8(root, tmp_path, edit_tensors=None, edit_config=None):
    """A copy of the FP8 checkpoint with its tensors or config.json edited."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    src = shutil.copytree(root / "fp8", tmp_path / "src")
    if edit_tensors is not None:
        tensors = load_file(src / "model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    if edit_config is not None:
        config = json.loads((src / "config.json").read_text())
        edit_config(config)
        (src / "config.json").write_text(json.dumps(config))
    return src


Q_A = "model.layers.0.self_attn.q_a_proj.weight"
ROUTER = "model.layers.1.mlp.gate.weight"


def fp8_router(tensors):
    tensors[ROUTER] = tensors[ROUTER].to(torch.float8_e4m3fn)
    tensors[ROUTER + "_scale_inv"] = torch.ones(1, 4)


@pytest.mark.parametrize("edit_tensors, edit_config, needles", [
    (lambda t: t.pop(Q_A + "_scale_inv"), None, [f"missing tensor '{Q_A}_scale_inv', the scales of FP8 '{Q_A}'"]),
    (lambda t: t.__setitem__(Q_A + "_scale_inv", torch.ones(2, 2)), None,
     [f"'{Q_A}_scale_inv' has shape [2, 2]; '{Q_A}' [8, 16] in blocks of 4 x 4 implies [2, 4]"]),
    (lambda t: t.__setitem__(ROUTER + "_scale_inv", torch.ones(1, 4)), None,
     [f"'{ROUTER}_scale_inv' holds FP8 scales of '{ROUTER}', which is float32, not FP8"]),
    (fp8_router, None, [f"tensor '{ROUTER}' is FP8, but the model keeps 'moe_layers.mlp.gate.weight' unquantized"]),
    (lambda t: t.__setitem__("model.norm.weight_scale_inv", torch.ones(1)), None,
     ["'model.norm.weight_scale_inv' holds FP8 scales of 'model.norm.weight', which is float32, not FP8"]),
    (None, lambda c: c["quantization_config"].__setitem__("weight_block_size", [4, 8]),
     ["config.json: 'quantization_config': expected FP8 of fmt \"e4m3\" in square blocks", "[4, 8]"]),
    (None, lambda c: c["quantization_config"].__setitem__("fmt", "e5m2"), ["found fmt 'e5m2'"]),
    (None, lambda c: c.pop("quantization_config"), ["_scale_inv' holds FP8 scales, but config.json has no fp8 "
                                                    "'quantization_config'"]),
])
def test_a_malformed_fp8_checkpoint_is_refused_in_one_line(deepseek_checkpoints, tmp_path, capsys, edit_tensors,
                                                           edit_config, needles):
    from test_converter_quantize import assert_refused, run

    root, _, _ = deepseek_checkpoints
    src = edited_fp8(root, tmp_path, edit_tensors, edit_config)
    code, err = run(capsys, "--src", str(src), "--out", str(tmp_path / "out"))
    assert_refused(code, err, tmp_path, *needles)


@pytest.mark.parametrize("options", [["--quantize", "nf4"], ["--quantize", "fp8"]])
def test_an_fp8_checkpoint_is_not_quantized_again(deepseek_checkpoints, tmp_path, capsys, options):
    from test_converter_quantize import assert_refused, run

    root, _, _ = deepseek_checkpoints
    code, err = run(capsys, "--src", str(root / "fp8"), "--out", str(tmp_path / "out"), *options)
    assert_refused(code, err, tmp_path, f"{root / 'fp8'} is FP8 in blocks of 4, kept as it is (leave out --quantize)",
                   exit_code=2)
    assert main_ok(["--src", str(root / "fp8"), "--out", str(tmp_path / "out"), "--quantize", "fp8",
                    "--quant-block", "4"])


def main_ok(argv) -> bool:
    from converter.cli import main

    return main([*argv, "--no-progress"]) == 0


def test_fp8_blocks_that_would_straddle_an_experts_gate_and_up_are_refused(deepseek_checkpoints, tmp_path, capsys):
    from test_converter_quantize import assert_refused, run

    root, _, _ = deepseek_checkpoints
    code, err = run(capsys, "--src", str(root / "hf"), "--out", str(tmp_path / "out"), "--quantize", "fp8",
                    "--quant-block", "16")  # the experts' 8 gate rows and 8 up rows in one block of 16
    assert_refused(code, err, tmp_path, "FP8 blocks of 16 straddle the 2 fused parts of "
                   "'model.layers.1.mlp.experts.gate_up_proj' (16 rows)")


@pytest.mark.slow
def test_a_model_holds_fp8_codes_as_their_bits_and_the_step_makes_no_wider_copy():
    """XLA:CPU has no FP8 arithmetic: given float8 parameters it converted every layer's codes to float16 at once,
    outside the layer scan (a plan of DeepSeek-V3 counted 82 GB a device of it). Held as uint8 bits and decoded per
    layer, the step's temporaries stay below such a copy."""
    from test_quantization import grad_temp_bytes

    config = ModelConfig(vocab_size=64, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    model = CausalLM(config, quantization=Quantization("fp8", 32), rngs=nnx.Rngs(0))
    codes = [v for p, v in nnx.to_flat_state(nnx.state(model, QuantizedParam)) if p[-1] == "codes"]
    assert {v[...].dtype for v in codes} == {np.dtype(np.uint8)}
    float16_copy = 2 * sum(v[...].size for v in codes)
    assert grad_temp_bytes(model) < float16_copy
