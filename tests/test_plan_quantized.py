"""finetune-lora --plan on a quantized base: from a config with --quantize, or from a converted quantized --model;
the frozen weights cost exactly their codes and scales."""

import json

import pytest

from converter import convert
from finetune.cli import main
from finetune.config import TrainConfig
from finetune.planning.plan import plan

# Every projection's input dimension is a multiple of 64 (the default block), and every dimension the fsdp=4
# mesh splits is a multiple of 4 blocks, so that each device holds exactly a quarter of each split weight.
SMALL = {"model_type": "llama", "vocab_size": 512, "hidden_size": 256, "intermediate_size": 512,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
         "torch_dtype": "bfloat16"}
MESH = "dp=2,fsdp=4,mp=1"  # dp replicates: each device holds a quarter of each split weight


@pytest.fixture
def small_config(tmp_path, default_allocator):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(SMALL))
    return path


def weight_bytes_per_device(c: dict, scheme: str | None, block: int = 64, fsdp: int = 4) -> float:
    """Bytes of frozen weights on one device, counted from the config: each projection `[out, in]` as codes
    (half a byte per value for nf4, one for int8) and one float32 scale per `block` values, or as bf16; the
    embedding and LM head in bf16; all of these split over fsdp (along the hidden dimension); the norms (bf16)
    on every device whole."""
    hidden, inter = c["hidden_size"], c["intermediate_size"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    projections = [(q, hidden), (kv, hidden), (kv, hidden), (hidden, q), (inter, hidden), (inter, hidden),
                   (hidden, inter)]
    code_bytes = {"nf4": 0.5, "int8": 1.0, "fp8": 1.0}
    per_layer = 0.0
    for out_features, in_features in projections:
        values = out_features * in_features
        scales = (out_features // block) * (in_features // block) if scheme == "fp8" else values // block  # fp8: 2-D
        per_layer += 2 * values if scheme is None else values * code_bytes[scheme] + scales * 4
    split = c["num_hidden_layers"] * per_layer + 2 * 2 * c["vocab_size"] * hidden
    norms = 2 * (2 * c["num_hidden_layers"] + 1) * hidden
    return split / fsdp + norms


def planned(path, **kw):
    return plan(TrainConfig(plan=True, model_config=str(path), mesh=MESH, batch_size=8, seq_len=64, dtype="float32",
                            **kw).validate(), cpu_bf16_figure=False)


@pytest.mark.slow
def test_plan_weights_are_the_codes_and_scales_and_a_quantized_plan_is_smaller(small_config):
    blocks = {"none": 64, "nf4": 64, "int8": 64, "fp8": 32}  # fp8's 32 x 32: 8 blocks of the hidden 256 over fsdp=4
    reports = {scheme: planned(small_config, quantize=scheme, quant_block=None if scheme != "fp8" else 32)
               for scheme in blocks}
    for scheme, report in reports.items():
        assert report.weights == weight_bytes_per_device(SMALL, None if scheme == "none" else scheme,
                                                         blocks[scheme]), scheme
    # nf4: 0.5 B per value + 4 B per 64 values = 0.5625 B; int8: 1.0625 B; fp8: 1 B + 4 B per 1024 values; bf16: 2 B
    assert reports["nf4"].weights < reports["fp8"].weights < reports["int8"].weights < reports["none"].weights
    assert reports["nf4"].total < reports["int8"].total < reports["none"].total
    # the same model either way: LoRA, optimizer state and batch do not change, nor the parameter count
    assert len({r.lora_and_optimizer for r in reports.values()}) == 1
    assert len({r.batch for r in reports.values()}) == 1
    assert len({r.frozen_parameters for r in reports.values()}) == 1
    assert "frozen projections nf4 in blocks of 64 (--quantize)" in str(reports["nf4"])
    assert "frozen projections fp8 in blocks of 32 x 32 (--quantize)" in str(reports["fp8"])
    assert "quantized" not in str(reports["none"]) and "nf4" not in str(reports["none"])


@pytest.mark.slow
def test_plan_of_a_quantized_checkpoint_takes_its_quantization(tiny_checkpoint, tiny_converted, tmp_path, capsys):
    int8 = tmp_path / "int8"
    convert(tiny_checkpoint, int8, quantize="int8", quant_block=16, progress=False)
    args = ["--plan", "--mesh", "dp=8,fsdp=1,mp=1", "--batch-size", "8", "--seq-len", "32", "--dtype", "float32",
            "--targets", "q_proj,v_proj", "--remat", "none"]
    tiny = json.loads((tiny_converted / "config.json").read_text())
    from_model = plan(TrainConfig(plan=True, model=str(int8), mesh="dp=8,fsdp=1,mp=1", batch_size=8, seq_len=32,
                                  dtype="float32", targets="q_proj,v_proj", remat="none").validate(),
                      cpu_bf16_figure=False)
    # dp only: every device holds all the weights
    assert from_model.weights == weight_bytes_per_device(tiny, "int8", block=16, fsdp=1) + \
        (4 - 2) * (2 * tiny["vocab_size"] * tiny["hidden_size"] + (2 * tiny["num_hidden_layers"] + 1) *
                   tiny["hidden_size"])  # embeddings, norms and LM head in float32 as stored
    assert main(args + ["--model", str(int8)]) == 0
    assert "frozen projections int8 in blocks of 16 (from the checkpoint)" in capsys.readouterr().out
    assert main(args + ["--model", str(int8), "--quantize", "int8"]) == 0  # agreeing: fine
    capsys.readouterr()
    assert main(args + ["--model", str(int8), "--quantize", "nf4"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"finetune-lora: error: --quantize nf4: {int8} is quantized int8 (block 16); a plan of a converted "
        "checkpoint takes its quantization (leave --quantize out, or plan --model-config with --quantize)"]
    assert main(args + ["--model", str(tiny_converted), "--quantize", "nf4"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"finetune-lora: error: --quantize nf4: {tiny_converted} holds unquantized weights; a plan of a converted "
        "checkpoint takes its quantization (leave --quantize out, or plan --model-config with --quantize)"]


def test_a_block_that_does_not_divide_the_projections_is_one_line(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**SMALL, "hidden_size": 96, "head_dim": 24}))
    assert main(["--plan", "--model-config", str(path), "--mesh", MESH, "--quantize", "nf4"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"finetune-lora: error: --quantize nf4: quantization block 64 does not divide the input dimension 96 of "
        f"q_proj ({path}); convert-llama --quant-block sets the block"]


@pytest.mark.slow
def test_a_plan_multiplying_in_fp8_holds_the_same_weights_and_says_so(small_config, tmp_path, capsys):
    """--fp8-matmul changes how the codes are multiplied, not what is held; it takes an fp8 base, else one line."""
    plain, fp8 = (planned(small_config, quantize="fp8", quant_block=32, fp8_matmul=matmul)
                  for matmul in ("off", "e4m3fnuz"))
    assert fp8.weights == plain.weights and fp8.lora_and_optimizer == plain.lora_and_optimizer
    assert "multiplied in e4m3fnuz (--fp8-matmul; its dots timed at --dtype's rate)" in str(fp8)
    assert "dequantized layer by layer" in str(plain)
    for quantize, held in (("nf4", "quantized nf4"), ("none", "not quantized")):
        assert main(["--plan", "--model-config", str(small_config), "--mesh", MESH, "--quantize", quantize,
                     "--fp8-matmul", "e4m3fn"]) == 2
        assert capsys.readouterr().err.splitlines() == [
            f"finetune-lora: error: --fp8-matmul e4m3fn: the base is {held}; FP8 matmuls take an fp8 base (an FP8 "
            "checkpoint, or convert-llama --quantize fp8)"]


def test_fit_command_line_trains_on_a_quantized_checkpoint_without_a_quantize_option(small_config):
    from finetune.planning.fit import command_line

    line = command_line(TrainConfig(plan=True, model_config=str(small_config), quantize="nf4", seq_len=256))
    assert line == "finetune-lora --model NF4_CONVERTED_DIR --data DATA.jsonl --out RUN_DIR --seq-len 256"
