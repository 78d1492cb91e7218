"""convert-llama on every input form it accepts: layouts, dtypes, verification, reruns, hub ids."""

import errno
import json
import shutil
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from isolation import run_without
from safetensors.numpy import load_file
from transformers import LlamaForCausalLM as HFLlamaForCausalLM

from converter import ConversionError, convert, verify
from jaxmodel.families import llama
from jaxmodel.formats.hf_names import NameTable
from demo.tiny import build_tiny_model
from jaxmodel import load_pretrained
from jaxmodel.formats.checkpoint import MANIFEST, CheckpointError

LLAMA_NAMES = NameTable(llama.MODULES)
hf_to_jax, jax_to_hf = LLAMA_NAMES.hf_to_jax, LLAMA_NAMES.jax_to_hf

SMALL = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 8}


def hf_state(directory: Path) -> dict[str, np.ndarray]:
    model = HFLlamaForCausalLM.from_pretrained(directory, dtype=torch.float32)
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}


def stored(out: Path) -> dict[str, np.ndarray]:
    """Every stored parameter, read with the `safetensors` package (a standard tool)."""
    tensors = {}
    for file in sorted((out / "params").glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def assert_matches_hf(out: Path, state: dict[str, np.ndarray], dtype=None):
    tensors = stored(out)
    expected_names = {hf_to_jax(n)[0] for n in state if n != "lm_head.weight" or "lm_head.weight" in tensors}
    assert set(tensors) == expected_names
    for name, value in state.items():
        path, layer = hf_to_jax(name)
        if path not in tensors:
            continue
        got = tensors[path][layer] if layer is not None else tensors[path]
        want = value if dtype is None else value.astype(dtype)
        assert got.dtype == want.dtype, name
        np.testing.assert_array_equal(got, want, err_msg=name)


def logits_match(hf_dir: Path, out: Path) -> float:
    """The converted model's largest logit difference from transformers', relative to the largest logit (as
    tests/test_parity.py scales its bound): at logits near 7 float32 rounding alone moves them by ~1e-5."""
    import jax.numpy as jnp

    hf = HFLlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ids = np.random.default_rng(0).integers(0, hf.config.vocab_size, (2, 17))
    with torch.no_grad():
        expected = hf(torch.tensor(ids)).logits.numpy()
    got = np.asarray(load_pretrained(out)(jnp.asarray(ids, jnp.int32)))
    return float(np.abs(got - expected).max() / max(1.0, np.abs(expected).max()))


def test_single_file_safetensors(tmp_path):
    src = build_tiny_model(tmp_path / "hf", SMALL, tokenizer=False)
    assert (src / "model.safetensors").is_file()
    summary = convert(src, tmp_path / "out", progress=False)
    assert summary.tensors == len(hf_state(src)) and summary.bytes > 0
    assert_matches_hf(tmp_path / "out", hf_state(src))
    assert logits_match(src, tmp_path / "out") < 1e-5


def test_sharded_safetensors_with_index_and_aux_files(tiny_checkpoint, tiny_converted):
    assert len(list(tiny_checkpoint.glob("model-*.safetensors"))) > 1
    assert_matches_hf(tiny_converted, hf_state(tiny_checkpoint))
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (tiny_converted / name).read_bytes() == (tiny_checkpoint / name).read_bytes()
    assert logits_match(tiny_checkpoint, tiny_converted) < 1e-5


@pytest.mark.parametrize("shard", [None, 40_000])
def test_torch_bin_checkpoints(tmp_path, shard):
    src = build_tiny_model(tmp_path / "hf", SMALL, weights="bin", max_shard_size=shard, tokenizer=False)
    assert (src / ("pytorch_model.bin" if shard is None else "pytorch_model.bin.index.json")).is_file()
    convert(src, tmp_path / "out", progress=False)
    reference = build_tiny_model(tmp_path / "ref", SMALL, tokenizer=False)  # same seed, safetensors
    assert_matches_hf(tmp_path / "out", hf_state(reference))


def test_tied_embeddings_store_no_head(tmp_path):
    src = build_tiny_model(tmp_path / "hf", {**SMALL, "tie_word_embeddings": True}, tokenizer=False)
    convert(src, tmp_path / "out", progress=False)
    assert "lm_head.weight" not in stored(tmp_path / "out")
    assert logits_match(src, tmp_path / "out") < 1e-5


def test_legacy_config_dialect(tmp_path):
    src = build_tiny_model(tmp_path / "hf", SMALL, tokenizer=False)
    config = json.loads((src / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
    (src / "config.json").write_text(json.dumps(config))
    convert(src, tmp_path / "out", progress=False)
    assert "rope_scaling" in json.loads((tmp_path / "out" / "config.json").read_text())
    assert logits_match(src, tmp_path / "out") < 1e-5


@pytest.mark.parametrize("dtype, np_dtype", [("bfloat16", ml_dtypes.bfloat16), ("float16", np.float16)])
def test_dtype_cast_rounds_like_torch(tmp_path, dtype, np_dtype):
    src = build_tiny_model(tmp_path / "hf", SMALL, tokenizer=False)
    convert(src, tmp_path / "out", dtype=dtype, progress=False)
    torch_dtype = getattr(torch, dtype)
    model = HFLlamaForCausalLM.from_pretrained(src, dtype=torch.float32)
    for name, value in model.state_dict().items():
        path, layer = hf_to_jax(name)
        got = stored(tmp_path / "out")[path]
        got = got[layer] if layer is not None else got
        want = value.to(torch_dtype)
        assert got.dtype == np_dtype
        np.testing.assert_array_equal(got.view(np.uint16), want.view(torch.int16).numpy().view(np.uint16))


def test_keep_preserves_a_bf16_source_bit_for_bit(tmp_path):
    src = build_tiny_model(tmp_path / "hf", SMALL, dtype="bfloat16", tokenizer=False)
    convert(src, tmp_path / "out", progress=False)
    tensors = stored(tmp_path / "out")
    assert {t.dtype for t in tensors.values()} == {np.dtype(ml_dtypes.bfloat16)}
    source = load_file(src / "model.safetensors")
    for name, value in source.items():
        path, layer = hf_to_jax(name)
        got = tensors[path][layer] if layer is not None else tensors[path]
        assert got.tobytes() == value.tobytes(), name


def test_verify_catches_a_flipped_byte(tmp_path, tiny_converted):
    out = tmp_path / "copy"
    shutil.copytree(tiny_converted, out)
    assert verify(out) > 0
    file = out / "params" / "layers.mlp.up_proj.weight.safetensors"
    data = bytearray(file.read_bytes())
    data[-3] ^= 0x10  # a byte in the last layer's slice
    file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"layers\.mlp\.up_proj\.weight.*checksum mismatch.* layer 1"):
        verify(out)


def test_convert_with_verify_fails_on_a_corrupted_write_and_leaves_nothing(tmp_path, tiny_checkpoint,
                                                                           monkeypatch):
    from jaxmodel.formats.checkpoint_writer import CheckpointWriter

    real_finish = CheckpointWriter.finish

    def finish_after_a_bit_flips_on_disk(self, info=None):
        file = self.directory / "params" / "norm.weight.safetensors"
        data = bytearray(file.read_bytes())
        data[-1] ^= 0x01
        file.write_bytes(bytes(data))
        return real_finish(self, info)

    monkeypatch.setattr(CheckpointWriter, "finish", finish_after_a_bit_flips_on_disk)
    with pytest.raises(ConversionError, match=r"out/params/norm\.weight\.safetensors: checksum mismatch in 'norm"):
        convert(tiny_checkpoint, tmp_path / "out", verify=True, progress=False)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("copy_error", [errno.EXDEV, errno.ENOSYS])
def test_byte_copy_falls_back_when_the_kernel_cannot_copy(tmp_path, tiny_checkpoint, tiny_converted, monkeypatch,
                                                          copy_error):
    import os

    def refuse(*args):
        raise OSError(copy_error, os.strerror(copy_error))

    monkeypatch.setattr(os, "copy_file_range", refuse)
    convert(tiny_checkpoint, tmp_path / "out", verify=True, progress=False)
    assert stored(tmp_path / "out").keys() == stored(tiny_converted).keys()
    for name, value in stored(tiny_converted).items():
        np.testing.assert_array_equal(stored(tmp_path / "out")[name], value)


def test_rerun_is_idempotent(tmp_path, tiny_checkpoint, tiny_converted):
    out = tmp_path / "again"
    convert(tiny_checkpoint, out, progress=False)
    convert(tiny_checkpoint, out, overwrite=True, progress=False)
    first = {p.relative_to(tiny_converted): p.read_bytes() for p in tiny_converted.rglob("*") if p.is_file()}
    again = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert first == again
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again"]


def test_name_table_round_trips():
    for name in ("model.embed_tokens.weight", "model.layers.12.self_attn.q_proj.weight",
                 "model.layers.0.self_attn.o_proj.bias", "model.layers.3.mlp.down_proj.weight",
                 "model.layers.7.post_attention_layernorm.weight", "model.norm.weight", "lm_head.weight"):
        assert jax_to_hf(*hf_to_jax(name)) == name
    assert hf_to_jax("model.layers.1.self_attn.rotary_emb.inv_freq") is None
    assert hf_to_jax("model.layers.x.mlp.up_proj.weight") is None


def make_hub_cache(cache: Path, repo_id: str, src: Path) -> str:
    """The layout huggingface_hub's cache has: blobs, snapshots/<commit>/ links, refs/main."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in src.iterdir():
        blob = repo / "blobs" / f"blob-{file.name}"
        shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(Path("../../blobs") / blob.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return commit


def run_cli(*args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    import os

    env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "converter.cli", *args], capture_output=True, text=True,
                          env=env, timeout=300)


@pytest.mark.slow
def test_hub_id_resolves_from_the_local_cache_offline(tmp_path, tiny_checkpoint):
    cache = tmp_path / "hub"
    make_hub_cache(cache, "meta-llama/Tiny-Llama-3.1", tiny_checkpoint)
    result = run_cli("--src", "meta-llama/Tiny-Llama-3.1", "--out", str(tmp_path / "out"), "--verify",
                     "--no-progress", env_extra={"HF_HUB_CACHE": str(cache)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("converted 21 tensors, ") and "(verified)" in result.stdout
    assert (tmp_path / "out" / MANIFEST).is_file()
    assert_matches_hf(tmp_path / "out", hf_state(tiny_checkpoint))


@pytest.mark.slow
def test_hub_id_missing_from_cache_offline_is_a_clear_error(tmp_path):
    result = run_cli("--src", "meta-llama/Not-Cached", "--out", str(tmp_path / "out"),
                     env_extra={"HF_HUB_CACHE": str(tmp_path / "empty")})
    assert result.returncode != 0
    assert result.stderr.strip().count("\n") == 0 and "Traceback" not in result.stderr
    assert "meta-llama/Not-Cached: not in the local HuggingFace cache" in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_safetensors_conversion_needs_no_torch(tmp_path, tiny_checkpoint):
    """A rocm/jax container has no torch: converting and loading safetensors must not import it."""
    result = run_without(("torch", "transformers", "peft"), (
        "from converter import convert\n"
        "from jaxmodel import load_pretrained\n"
        f"convert({str(tiny_checkpoint)!r}, {str(tmp_path / 'out')!r}, verify=True, progress=False)\n"
        f"load_pretrained({str(tmp_path / 'out')!r})\n"
        "print('ok')\n"
    ))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("ok")


@pytest.mark.slow
def test_bin_checkpoint_without_torch_is_a_clear_error(tmp_path):
    src = build_tiny_model(tmp_path / "hf", SMALL, weights="bin", tokenizer=False)
    result = run_without(("torch",), (
        "from converter.cli import main\n"
        f"sys.exit(main(['--src', {str(src)!r}, '--out', {str(tmp_path / 'out')!r}]))\n"
    ))
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"convert-llama: error: {src / 'pytorch_model.bin'}: a PyTorch pickle checkpoint; reading it needs torch "
        "(pip install 'llama-jax[torch]'), or convert from safetensors"
    ]


# Peak RSS is the process's VmHWM (ru_maxrss would carry the parent's peak across fork + exec), read once
# the imports are done and again after the conversion, as bench/convert.py does.
MEASURE_CONVERT = r"""
import json, sys
def high_water():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
from converter import convert
start = high_water()
convert(sys.argv[1], sys.argv[2], dtype=sys.argv[3], progress=False)
print(json.dumps({"start": start, "peak": high_water()}))
"""

# hidden 1024, intermediate 65536, 2 layers, bf16: gate/up/down are 128 MB each (twice the converter's 64 MB
# chunk), 808 MB in all; holding a whole tensor, let alone the checkpoint, shows in the peak.
BIG = {"model_type": "llama", "vocab_size": 8192, "hidden_size": 1024, "intermediate_size": 65536,
       "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 8, "torch_dtype": "bfloat16"}


def write_big_checkpoint(directory: Path) -> int:
    """A bf16 safetensors checkpoint of BIG's shapes, written tensor by tensor; returns the largest tensor's bytes."""
    import os

    from jaxmodel.formats.safetensors_file import write_header

    h, f, v = BIG["hidden_size"], BIG["intermediate_size"], BIG["vocab_size"]
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    for i in range(BIG["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       **{p + f"self_attn.{m}_proj.weight": (h, h) for m in "qkvo"},
                       p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                       p + "mlp.down_proj.weight": (h, f)})
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(BIG))
    fd = os.open(directory / "model.safetensors", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        spans = write_header(fd, [(n, ml_dtypes.bfloat16, s) for n, s in shapes.items()], {"format": "pt"})
        for name, shape in shapes.items():
            values = (np.arange(np.prod(shape), dtype=np.uint32) % 251 + 0x3C00).astype(np.uint16)
            os.pwrite(fd, values.tobytes(), spans[name].offset)
    finally:
        os.close(fd)
    return max(int(np.prod(s)) * 2 for s in shapes.values())


@pytest.mark.slow
@pytest.mark.parametrize("dtype, itemsize", [("keep", 2), ("float32", 4)])  # kernel copy; chunked read + cast
def test_peak_memory_stays_below_twice_the_largest_tensor(tmp_path, dtype, itemsize):
    """The converter holds a few 64 MB chunks at a time, not the checkpoint: measured growth 0.64x the
    largest tensor as stored for the byte copy, 1.3x when casting to float32 (a 64 MB read buffer and two
    128 MB cast chunks); reading the whole file first grows it 7.0x / 4.5x. (At this size a whole tensor
    held at once, 1.5x when casting, is not told apart from chunks.)"""
    largest_source = write_big_checkpoint(tmp_path / "hf")
    assert largest_source == 128 << 20
    largest_stored = largest_source * itemsize // 2
    command = [sys.executable, "-c", MEASURE_CONVERT, str(tmp_path / "hf"), str(tmp_path / "out"), dtype]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr
    rss = json.loads(result.stdout.strip().splitlines()[-1])
    growth = rss["peak"] - rss["start"]
    assert growth < 2 * largest_stored, f"peak RSS grew {growth / largest_stored:.2f}x the largest tensor"
