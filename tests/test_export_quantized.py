"""export-peft on a run over a quantized base: the same PEFT adapter as over an unquantized one (its card says
which base it trained on), and --merge only into unquantized weights (--merge-base), byte for byte the merge of
the same adapter into those weights."""

import hashlib
import json
import shutil

import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM as HFLlamaForCausalLM

from converter import convert
from demo.tiny import build_tiny_model
from export.cli import main as export_main
from finetune.config import TrainConfig
from finetune.train.loop import run_training

IDS = np.random.default_rng(5).integers(6, 512, (2, 19))


@pytest.fixture(scope="module")
def converted(tiny_checkpoint, tmp_path_factory):
    """The tiny checkpoint converted three ways: nf4, bf16, and int8 (block 16)."""
    root = tmp_path_factory.mktemp("converted")
    convert(tiny_checkpoint, root / "nf4", quantize="nf4", progress=False)
    convert(tiny_checkpoint, root / "bf16", dtype="bfloat16", progress=False)
    convert(tiny_checkpoint, root / "int8", quantize="int8", quant_block=16, progress=False)
    return root


@pytest.fixture(scope="module")
def nf4_run(converted, tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "run"
    data = out.parent / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"add {i} + {i} =", "completion": f" {2 * i}"}) + "\n"
                            for i in range(32)))
    run_training(TrainConfig(model=str(converted / "nf4"), data=str(data), out=str(out), steps=4, batch_size=8,
                             seq_len=32, dtype="float32", lr=1e-2, progress=False).validate())
    return out


def same_run_on(run_dir, base, tmp_path):
    """A copy of the run whose recorded base is `base`: the same adapters, as if trained there."""
    copy = tmp_path / f"run-on-{base.name}"
    shutil.copytree(run_dir, copy)
    config = json.loads((copy / "run_config.json").read_text())
    (copy / "run_config.json").write_text(json.dumps({**config, "model": str(base)}))
    return copy


def files(directory) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def merged_files(directory) -> dict[str, str]:
    """The sha256 of each of a merge's files less its README.md, which names the run it came from (digests: a
    failing comparison of whole weight files would spend minutes diffing their bytes)."""
    return {name: hashlib.sha256(data).hexdigest() for name, data in files(directory).items() if name != "README.md"}


@pytest.mark.slow
def test_adapter_is_the_one_an_unquantized_base_gives_and_its_card_names_the_quantization(tmp_path, nf4_run,
                                                                                          converted):
    bf16_run = same_run_on(nf4_run, converted / "bf16", tmp_path)
    for run, out in ((nf4_run, tmp_path / "from-nf4"), (bf16_run, tmp_path / "from-bf16")):
        assert export_main(["--run", str(run), "--out", str(out), "--base-model", "meta-llama/x"]) == 0
    ours, plain = files(tmp_path / "from-nf4"), files(tmp_path / "from-bf16")
    assert set(ours) == {"adapter_model.safetensors", "adapter_config.json", "README.md"}
    assert ours["adapter_model.safetensors"] == plain["adapter_model.safetensors"]
    assert ours["adapter_config.json"] == plain["adapter_config.json"]
    card, plain_card = ours["README.md"].decode(), plain["README.md"].decode()
    assert "| base quantization in training | nf4, blocks of 64 (QLoRA: convert-llama --quantize nf4 " \
           "--quant-block 64) |" in card.splitlines()
    assert "| base quantization in training | none |" in plain_card.splitlines()
    assert [line for line in card.splitlines() if "quantization" not in line] == \
        [line for line in plain_card.splitlines() if "quantization" not in line]


@pytest.mark.slow
def test_merge_without_unquantized_weights_is_one_line_and_writes_nothing(tmp_path, nf4_run, converted, capsys):
    code = export_main(["--run", str(nf4_run), "--out", str(tmp_path / "adapter"), "--merge", str(tmp_path / "m")])
    assert code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"export-peft: error: --merge: the run's base {converted / 'nf4'} is quantized nf4 (block 64); merging needs "
        "its unquantized weights: add --merge-base DIR (a converted unquantized checkpoint, or the HF checkpoint it "
        "was converted from)"]
    assert not (tmp_path / "adapter").exists() and not (tmp_path / "m").exists()


@pytest.mark.slow
def test_merge_into_a_bf16_converted_base_equals_the_plain_merge_byte_for_byte(tmp_path, nf4_run, converted):
    assert export_main(["--run", str(nf4_run), "--merge", str(tmp_path / "merged"), "--merge-base",
                        str(converted / "bf16"), "--max-shard-size", "100KB"]) == 0
    plain = same_run_on(nf4_run, converted / "bf16", tmp_path)
    assert export_main(["--run", str(plain), "--merge", str(tmp_path / "plain"), "--max-shard-size", "100KB"]) == 0
    merged = merged_files(tmp_path / "merged")
    assert len([name for name in merged if name.endswith(".safetensors")]) > 1
    assert merged == merged_files(tmp_path / "plain")
    # transformers loads it (the plain merge's logits are checked in tests/test_export.py)
    model = HFLlamaForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor(IDS)).logits).all()


@pytest.mark.slow
def test_merge_into_the_hf_checkpoint_equals_the_merge_into_its_conversion(tmp_path, nf4_run, tiny_checkpoint,
                                                                          tiny_converted, capsys, monkeypatch):
    """The HF checkpoint (float32, sharded) read directly, in chunks of 4 KB, gives the same files as the merge
    into its float32 conversion."""
    from jaxmodel.formats import hf_checkpoint

    monkeypatch.setattr(hf_checkpoint, "CHUNK_BYTES", 4096)
    assert export_main(["--run", str(nf4_run), "--merge", str(tmp_path / "merged"), "--merge-base",
                        str(tiny_checkpoint)]) == 0
    assert f"into --merge-base {tiny_checkpoint} ->" in capsys.readouterr().out
    plain = same_run_on(nf4_run, tiny_converted, tmp_path)
    assert export_main(["--run", str(plain), "--merge", str(tmp_path / "plain")]) == 0
    assert merged_files(tmp_path / "merged") == merged_files(tmp_path / "plain")


@pytest.mark.slow
def test_merge_base_of_another_model_or_quantized_is_one_line(tmp_path, nf4_run, converted, capsys):
    other = build_tiny_model(tmp_path / "other", {"hidden_size": 32, "head_dim": 8}, tokenizer=False)
    capsys.readouterr()
    cases = [(other, f"export-peft: error: {other / 'config.json'}: hidden_size is 32, the run's base "
                     f"({converted / 'nf4'}) has 64: not the weights of that model"),
             (converted / "int8", f"export-peft: error: {converted / 'int8'}: quantized int8 (block 16): a merge "
                                  "needs unquantized weights")]
    for merge_base, message in cases:
        code = export_main(["--run", str(nf4_run), "--merge", str(tmp_path / "m"), "--merge-base", str(merge_base)])
        assert code == 1 and capsys.readouterr().err.splitlines() == [message]
        assert not (tmp_path / "m").exists()
    with pytest.raises(SystemExit):
        export_main(["--run", str(nf4_run), "--out", str(tmp_path / "a"), "--merge-base", str(converted / "bf16")])
    assert "--merge-base goes with --merge" in capsys.readouterr().err


@pytest.fixture(scope="module")
def fp8_run(tiny_checkpoint, tmp_path_factory):
    """A run on the tiny checkpoint converted with `--quantize fp8` in blocks of 16 (partial ones: hidden 64 is 4,
    its 96 MLP rows 6, its 32-wide k/v rows 2)."""
    root = tmp_path_factory.mktemp("fp8")
    convert(tiny_checkpoint, root / "fp8", quantize="fp8", quant_block=16, progress=False)
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"add {i} + {i} =", "completion": f" {2 * i}"}) + "\n"
                            for i in range(32)))
    run_training(TrainConfig(model=str(root / "fp8"), data=str(data), out=str(root / "run"), steps=4, batch_size=8,
                             seq_len=32, dtype="float32", lr=1e-2, progress=False).validate())
    return root / "run", root / "fp8"


def peft_merged_weights(fp8_dir, adapter_dir) -> dict[str, np.ndarray]:
    """transformers' Llama on the FP8 base's weights dequantized by hand (torch), the exported adapter merged into
    it by PEFT's merge_and_unload, in float32: the merge a merged checkpoint must hold."""
    from peft import PeftModel

    from jaxmodel.formats.hf_names import names_of
    from jaxmodel import ModelConfig
    from test_fp8 import stored

    from transformers import LlamaConfig

    names = names_of(ModelConfig.from_hf(fp8_dir))
    model = HFLlamaForCausalLM(LlamaConfig.from_pretrained(fp8_dir)).float()
    state = model.state_dict()
    for name in state:
        path, layer = names.hf_to_jax(name)
        if not path.endswith("proj.weight"):
            value = stored(fp8_dir, path)
            state[name] = torch.from_numpy(value if layer is None else value[layer]).float()
            continue
        module = path.removesuffix(".weight")
        codes, scales = stored(fp8_dir, module + ".codes")[layer], stored(fp8_dir, module + ".scales")[layer]
        scale = torch.from_numpy(scales).repeat_interleave(16, 0).repeat_interleave(16, 1)
        rows, cols = codes.shape
        state[name] = torch.from_numpy(codes.view(np.uint8)).view(torch.float8_e4m3fn).float() * scale[:rows, :cols]
    model.load_state_dict(state)
    merged = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    return {k: v.numpy() for k, v in merged.state_dict().items()}


@pytest.mark.slow
def test_merge_of_an_fp8_run_is_peft_merge_requantized_or_in_bf16(tmp_path, fp8_run, capsys):
    """No --merge-base: the FP8 base is the model. Kept in FP8, each merged projection is transformers' quantizer's
    FP8 of PEFT's merge (its scales too, config.json's quantization_config added); --merge-dtype bfloat16 is that
    merge rounded to bf16. transformers reads both."""
    from safetensors.torch import load_file

    from test_fp8 import transformers_fp8

    run, fp8_dir = fp8_run
    assert export_main(["--run", str(run), "--out", str(tmp_path / "adapter"), "--merge", str(tmp_path / "fp8")]) == 0
    assert export_main(["--run", str(run), "--merge", str(tmp_path / "bf16"), "--merge-dtype", "bfloat16"]) == 0
    want = peft_merged_weights(fp8_dir, tmp_path / "adapter")
    fp8, bf16 = load_file(tmp_path / "fp8" / "model.safetensors"), load_file(tmp_path / "bf16" / "model.safetensors")
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                             "weight_block_size": [16, 16]}
    assert "quantization_config" not in json.loads((tmp_path / "bf16" / "config.json").read_text())
    projections = [name for name in want if name.endswith("proj.weight")]
    assert len(projections) == 7 * 2 and set(fp8) == set(want) | {n + "_scale_inv" for n in projections}
    for name in projections:
        codes, scales = transformers_fp8(want[name], 16)
        assert fp8[name].dtype == torch.float8_e4m3fn
        np.testing.assert_array_equal(fp8[name].view(torch.uint8).numpy(), codes, err_msg=name)
        np.testing.assert_array_equal(fp8[name + "_scale_inv"].numpy(), scales, err_msg=name)
    for name, value in want.items():
        expected = torch.from_numpy(value).to(torch.bfloat16).view(torch.int16).numpy()
        np.testing.assert_array_equal(bf16[name].view(torch.int16).numpy(), expected, err_msg=name)
    # transformers reads the FP8 one (on a CPU it dequantizes to bf16) and the bf16 one
    for merged in ("fp8", "bf16"):
        model = HFLlamaForCausalLM.from_pretrained(tmp_path / merged).eval()
        with torch.no_grad():
            assert torch.isfinite(model(torch.tensor(IDS)).logits).all()
