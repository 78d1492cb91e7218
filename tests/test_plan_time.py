"""`--plan`'s predicted time: the compiled step's collectives are those each layout implies (8 simulated devices),
counted as often as the layer scan runs them; the device models and the prediction built on them."""

import dataclasses
import json
import math

import pytest

from finetune.cli import main
from finetune.config import TrainConfig
from finetune.planning.devices import (DEVICE_MODELS, DeviceModelError, default_device_model, device_model_from_report,
                                       load_device_model)
from finetune.planning.hlo_cost import Collective, StepCost
from finetune.planning.plan import plan
from finetune.planning.timing import predict

# float32 weights, so that every weight is gathered in the dtype it is stored in; hidden 256 = 8 heads of 32
TINY = {"model_type": "llama", "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 8, "torch_dtype": "float32"}
BATCH, SEQ, RANK = 8, 64, 8
F32 = 4


def layer_weights(config: dict) -> int:
    """Values of one decoder layer's seven projections."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    return 4 * hidden * hidden + 3 * hidden * inter


def lora_values(config: dict) -> int:
    """Values of every LoRA A and B (rank 8 on the seven projections of every layer)."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    kv = config["num_key_value_heads"] * hidden // config["num_attention_heads"]  # k_proj's and v_proj's outputs
    per_layer = (2 * (hidden + hidden) + 2 * (hidden + kv) + 3 * (hidden + inter)) * RANK
    return config["num_hidden_layers"] * per_layer


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """(mesh, layers, dtype) -> the plan of TINY with that many layers in that dtype (weights and compute), batch 8 x
    64, compiled once a module."""
    cache = {}

    def get(mesh: str, layers: int = 2, dtype: str = "float32"):
        if (mesh, layers, dtype) not in cache:
            path = tmp_path_factory.mktemp("config") / "config.json"
            path.write_text(json.dumps({**TINY, "num_hidden_layers": layers, "torch_dtype": dtype}))
            cache[mesh, layers, dtype] = plan(TrainConfig(plan=True, model_config=str(path), mesh=mesh,
                                                          batch_size=BATCH, seq_len=SEQ, dtype=dtype, rank=RANK,
                                                          hbm_gb=1).validate())
        return cache[mesh, layers, dtype]
    return get


def in_projections(collective) -> bool:
    """Whether a collective serves a frozen projection's matmul (not its LoRA branch)."""
    return "/projection/" in collective.op_name and "/lora/" not in collective.op_name


@pytest.mark.slow
def test_fsdp_gathers_every_frozen_layer_weight_once_a_pass(planned):
    cost = planned("dp=1,fsdp=8,mp=1").cost
    gathers = [c for c in cost.collectives if c.kind == "all-gather"]
    # the forward pass and the backward pass (the input gradients need the weights again) each gather every layer
    assert sum(c.bytes * c.count for c in gathers if in_projections(c)) == \
        2 * TINY["num_hidden_layers"] * layer_weights(TINY) * F32
    assert all(c.group == 8 for c in gathers)
    head = [c for c in gathers if "lm_head" in c.op_name]
    assert sum(c.bytes * c.count for c in head) == TINY["vocab_size"] * TINY["hidden_size"] * F32  # once, whole


@pytest.mark.slow
def test_a_bf16_step_planned_on_the_cpu_gathers_its_weights_in_bf16(planned):
    """XLA:CPU converts each layer's bf16 weights to float32 before gathering them; an accelerator gathers the bf16
    values, and the plan counts those."""
    cost = planned("dp=1,fsdp=8,mp=1", dtype="bfloat16").cost
    gathers = [c for c in cost.collectives if c.kind == "all-gather" and in_projections(c)]
    assert sum(c.bytes * c.count for c in gathers) == 2 * TINY["num_hidden_layers"] * layer_weights(TINY) * 2
    lora = [c for c in cost.collectives if c.kind == "all-gather" and "/lora/" in c.op_name]
    assert sum(c.bytes * c.count for c in lora) == 2 * lora_values(TINY) * F32  # LoRA stays float32


@pytest.mark.slow
def test_mp_gathers_no_frozen_weight_and_reduces_the_activations(planned):
    cost = planned("dp=1,fsdp=1,mp=8").cost
    assert not [c for c in cost.collectives if c.kind == "all-gather"]
    tokens = BATCH * SEQ
    # the forward pass reduces the partial sums of o_proj and down_proj (whose inputs are split over mp), each with
    # its LoRA branch's x A, once a layer
    forward = [c for c in cost.collectives if c.kind == "all-reduce" and in_projections(c) and "transpose(" not in
               c.op_name and "/checkpoint/" not in c.op_name]
    assert sum(c.count for c in forward) == 2 * TINY["num_hidden_layers"]
    assert {c.bytes for c in forward} == {tokens * (TINY["hidden_size"] + RANK) * F32}
    assert all(c.group == 8 for c in cost.collectives)


@pytest.mark.slow
def test_cp_with_several_rows_a_device_moves_no_projections_activations(tmp_path):
    """Under cp=8 a device holding 8 rows of 8 tokens moves, in the projections and their LoRA branches, what one
    holding 1 row of 64 tokens does: the weights' gathers, no activation (a token axis flattened over rows and
    the split sequence is no single tile a device: XLA gathered every projection's input and reduced LoRA's
    products over the whole batch, ~20 TB a step at 405B, 8 x 8192)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))

    def projections(batch):
        cost = plan(TrainConfig(plan=True, model_config=str(path), mesh="dp=1,fsdp=1,cp=8,mp=1", batch_size=batch,
                                seq_len=BATCH * SEQ // batch, dtype="float32", rank=RANK, hbm_gb=1).validate()).cost
        return sorted((c.kind, c.bytes, c.count) for c in cost.collectives if "projection/" in c.op_name)

    several = projections(BATCH)
    assert several == projections(1)
    # besides the weights' gathers, only the LoRA gradients' reduction
    assert sum(b * n for kind, b, n in several if kind != "all-gather") == lora_values(TINY) * F32


@pytest.mark.slow
def test_the_mlp_in_chunks_gathers_what_the_whole_mlp_does_and_moves_no_activation(tmp_path):
    """fsdp=8, one row of 1024 a device, the MLP wider than a chunk's tokens (hidden 1024, chunks of 128): in
    chunks it gathers the weights the whole MLP gathers and no activation (unpinned, XLA split each chunk's
    gradients over the intermediate axis with all-to-alls: 1.4 TB a step at 405B, 8 x 8192)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY, "hidden_size": 1024, "intermediate_size": 4096}))

    def collectives(mlp_chunk):
        cost = plan(TrainConfig(plan=True, model_config=str(path), mesh="dp=1,fsdp=8,mp=1", batch_size=8,
                                seq_len=1024, dtype="float32", rank=RANK, remat="full", mlp_chunk=mlp_chunk,
                                hbm_gb=1).validate()).cost
        return {kind: sum(c.bytes * c.count for c in cost.collectives if c.kind == kind)
                for kind in {c.kind for c in cost.collectives}}

    chunked, whole = collectives(128), collectives(0)
    assert "all-to-all" not in chunked
    assert chunked["all-gather"] == whole["all-gather"]


@pytest.mark.slow
@pytest.mark.parametrize("widths", [
    dict(hidden_size=1024, intermediate_size=4096, num_attention_heads=8, num_key_value_heads=2),
    dict(hidden_size=4096, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8),
], ids=["mlp-wide", "kv-heads-8"])
@pytest.mark.parametrize("quantize", ["none", "nf4"])
def test_fsdp_with_few_tokens_a_device_moves_no_activation(tmp_path, widths, quantize):
    """fsdp=8 with 128 tokens a device, far fewer than the model's widths: the weights are gathered and only the LoRA
    gradients (and the loss's scalars) reduced. Unpinned, XLA split the MLP's values and gradients over the
    intermediate axis (all-to-alls), the attention's over its heads (all-to-alls), or a layer's keys over their heads
    in the backward pass, reducing partial input gradients of the whole batch."""
    config = {**TINY, **widths}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    cost = plan(TrainConfig(plan=True, model_config=str(path), mesh="dp=1,fsdp=8,mp=1", batch_size=16, seq_len=64,
                            rank=RANK, hbm_gb=1, quantize=quantize, quant_block=32).validate()).cost
    assert {c.kind for c in cost.collectives} == {"all-gather", "all-reduce"}
    scalars = 1024  # the loss's sums and counts: tens of float32 numbers
    reduced = [c for c in cost.collectives if c.kind == "all-reduce" and c.bytes > scalars]
    assert sum(c.bytes * c.count for c in reduced) == lora_values(config) * F32


@pytest.mark.slow
def test_a_replicated_base_reduces_only_the_lora_gradients_and_scalars(planned):
    cost = planned("dp=8,fsdp=1,mp=1").cost
    assert {c.kind for c in cost.collectives} == {"all-reduce"}
    scalars = 64  # the loss's sums: a few float32 numbers
    assert sum(c.bytes * c.count for c in cost.collectives if c.bytes > scalars) == lora_values(TINY) * F32


@pytest.mark.slow
def test_loop_trip_counts_are_applied(planned):
    """2, 3 and 4 layers: every count grows by the same per-layer amount, which for the gathers is one layer's
    weights twice."""
    costs = {layers: planned("dp=1,fsdp=8,mp=1", layers).cost for layers in (2, 3, 4)}

    def figures(cost: StepCost) -> dict:
        totals = cost.collective_totals()
        return {"flops": cost.flops, "bytes": cost.bytes,
                **{f"{kind} {key}": value for kind, entry in totals.items() for key, value in entry.items()
                   if key != "group_size"}}
    two, three, four = (figures(costs[n]) for n in (2, 3, 4))
    for key in two:
        assert four[key] - two[key] == pytest.approx(2 * (three[key] - two[key]), rel=1e-9), key
    per_layer = sum(c.bytes * c.count for c in costs[3].collectives if in_projections(c)) - \
        sum(c.bytes * c.count for c in costs[2].collectives if in_projections(c))
    assert per_layer == 2 * layer_weights(TINY) * F32
    assert three["flops"] > two["flops"] and costs[2].unknown_trip_counts == []


def test_a_collective_takes_the_larger_of_its_latency_and_its_bus_bytes_over_the_bandwidth():
    device = DEVICE_MODELS["mi300x"]
    size = 2**30  # a table point: 314.7 GB/s over 8 GPUs
    assert device.collective_seconds("all-reduce", size, 8) == pytest.approx(size * 2 * 7 / 8 / 314.7e9)
    assert device.collective_seconds("all-gather", size, 8) == pytest.approx(size * 7 / 8 / 314.7e9)
    assert device.collective_seconds("all-reduce", 64, 8) == device.collective_latency_s
    assert device.collective_seconds("all-reduce", size, 1) == 0.0
    # a full mesh of links: 2 of the 8 GPUs share one link, 1/7 of the whole node's bandwidth
    assert device.bus_bytes_per_s(size, 2) == pytest.approx(314.7e9 / 7)
    # between table points: interpolated in log(size)
    between = device.bus_bytes_per_s(math.sqrt(2**27 * 2**30), 8)
    assert between == pytest.approx((294.6e9 + 314.7e9) / 2)


def test_a_measured_table_point_is_read_back_exactly():
    """A report's measured figure at one of its sizes is the figure, not a log-interpolation that rounds off it."""
    table = ((1024.0, 7636255372.238157), (1048576.0, 2948837400.672011))  # log-interpolation misses the last
    device = dataclasses.replace(DEVICE_MODELS["h200"], bus_bandwidth={2: table})
    assert [device.bus_bytes_per_s(size, 2) for size, _ in table] == [figure for _, figure in table]


def test_the_prediction_adds_each_ops_roofline_and_the_collectives():
    device = DEVICE_MODELS["h200"]
    rate, bandwidth = device.matmul_flops_per_s("bfloat16"), device.hbm_bytes_per_s
    # three matmuls of 1 ms each at the matmul rate (their bytes negligible), one op streaming 2 ms of bytes
    cost = StepCost(roofline_ops=[(rate * 1e-3, 1.0, 0.0, 3), (0.0, bandwidth * 2e-3, 0.0, 1)])
    p = predict(cost, device, "bfloat16", tokens=1000, model_flops=rate * 3e-3, devices=1)
    assert p.compute_seconds == pytest.approx(3e-3) and p.memory_seconds == pytest.approx(2e-3)
    assert p.communication_seconds == 0 and p.step_seconds == pytest.approx(5e-3) and p.bound == "compute"
    assert p.tokens_per_s == pytest.approx(1000 / 5e-3)
    assert p.mfu == pytest.approx(3e-3 * device.matmul_fraction / 5e-3)
    # and two all-gathers of 1 GiB over 8 devices, 7/8 of it over the bus each: nothing overlapped, or all of it
    cost.collectives = [Collective("all-gather", 2**30, 8, 2, "ag", "")]
    p = predict(cost, device, "bfloat16", tokens=1000, model_flops=rate * 3e-3, devices=8)
    gather = 2**30 * 7 / 8 / device.bus_bytes_per_s(2**30, 8)
    assert p.communication_seconds == pytest.approx(2 * gather) and p.bound == "communication"
    assert p.step_seconds == pytest.approx(5e-3 + 2 * gather) and p.overlapped_seconds == pytest.approx(2 * gather)
    assert p.collectives == {"all-gather": {"bytes": 2 * 2**30, "count": 2, "group_size": 8}}


@pytest.mark.slow
def test_the_plan_prints_and_predicts_on_the_named_device(planned):
    report = planned("dp=1,fsdp=8,mp=1")
    text = str(report)
    assert "predicted time per step on mi300x (float32)" in text and "all-gather: " in text
    assert report.prediction.communication_seconds > 0 and report.prediction.step_seconds > 0


def test_a_plan_on_a_cpu_is_for_the_target_node_and_on_a_gpu_for_itself():
    assert default_device_model("cpu", "cpu") is DEVICE_MODELS["mi300x"]
    assert default_device_model("NVIDIA H200", "gpu") is DEVICE_MODELS["h200"]
    assert default_device_model("AMD Instinct MI325X", "gpu") is DEVICE_MODELS["mi325x"]
    assert default_device_model("NVIDIA A100-SXM4-80GB", "gpu") is DEVICE_MODELS["mi300x"]


@pytest.mark.parametrize("args, message", [
    (["--device-model", "tpu9"], "--device-model tpu9: unknown device"),
    (["--plan-json", "/nonexistent-dir/plan.json"], "--plan-json /nonexistent-dir/plan.json: directory "
                                                   "/nonexistent-dir does not exist"),
])
def test_cli_bad_plan_options_are_one_line_before_compiling(tmp_path, capsys, args, message):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    assert main(["--plan", "--model-config", str(path), "--mesh", "dp=1,fsdp=8,mp=1", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.splitlines()) == 1
    assert captured.err.startswith(f"finetune-lora: error: {message}")


def test_plan_options_go_with_plan(capsys):
    assert main(["--device-model", "h100", "--model", "m", "--data", "d", "--out", "o"]) == 2
    assert capsys.readouterr().err.strip() == "finetune-lora: error: --device-model goes with --plan"


def test_device_models_by_name_and_from_a_report(tmp_path):
    assert load_device_model("MI300X") is DEVICE_MODELS["mi300x"]
    report = {"device_kind": "NVIDIA H200", "matmul_peak_flops": {"float32": 4e14, "bfloat16": 7.8e14},
              "memory_bandwidth": {"bytes_per_s": 4.2e12},
              "collectives": {"table": {"8": [[1048576, 5e10], [1073741824, 3.6e11]]}, "latency_s": 2e-5}}
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    model = load_device_model(str(path))
    assert model.matmul_flops_per_s("bfloat16") == 7.8e14 and model.hbm_bytes_per_s == 4.2e12
    assert model.bus_bytes_per_s(2**30, 8) == 3.6e11 and model.collective_latency_s == 2e-5
    one_device = device_model_from_report({**report, "collectives": {"skipped": "one device"}}, "r.json")
    assert one_device.collective_seconds("all-reduce", 2**20, 1) == 0.0


@pytest.mark.parametrize("spec, contents, message", [
    ("tpu9", None, "--device-model tpu9: unknown device (known: mi300x, mi325x, h100, h200; or a JSON file"),
    ("missing.json", None, "--device-model missing.json: cannot read it (No such file or directory)"),
    ("bad.json", "{", "--device-model bad.json: not valid JSON"),
    ("list.json", "[]", "--device-model list.json: expected a JSON object"),
    ("nopeak.json", '{"memory_bandwidth": {"bytes_per_s": 1e12}}',
     "--device-model nopeak.json: field matmul_peak_flops: expected an object of FLOP/s by dtype"),
    ("nobw.json", '{"matmul_peak_flops": {"float32": 1e12}}',
     "--device-model nobw.json: field memory_bandwidth.bytes_per_s: expected a positive number"),
    ("badtable.json", '{"matmul_peak_flops": {"float32": 1e12}, "memory_bandwidth": {"bytes_per_s": 1e12}, '
                      '"collectives": {"table": {"8": [[2, 1], [1, 1]]}, "latency_s": 0}}',
     "--device-model badtable.json: field collectives.table: expected an object {GROUP_SIZE:"),
])
def test_a_bad_device_model_is_one_line(tmp_path, monkeypatch, spec, contents, message):
    monkeypatch.chdir(tmp_path)
    if contents is not None:
        (tmp_path / spec).write_text(contents)
    with pytest.raises(DeviceModelError) as e:
        load_device_model(spec)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)
