"""bench/step_profile.py: its time sharing and op grouping on a made-up trace, and a run of the real step (two
layers, one traced step) whose matmul FLOPs per part equal the counts from the model's shape."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# a module of two fusions, a top-level dot and a zero fill, in the shape of XLA:CPU's optimized HLO text
HLO = """HloModule jit_train_step

%fused_dot (param_0: f32[16,8], param_1: f32[8,4]) -> f32[16,4] {
  %param_0 = f32[16,8]{1,0} parameter(0)
  %param_1 = f32[8,4]{1,0} parameter(1)
  ROOT %dot.1 = f32[16,4]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_mul (param_0.1: f32[16,4]) -> f32[16,4] {
  %param_0.1 = f32[16,4]{1,0} parameter(0)
  ROOT %multiply.1 = f32[16,4]{1,0} multiply(%param_0.1, %param_0.1)
}

ENTRY %main (x: f32[16,8], w: f32[8,4], v: f32[4,16]) -> f32[16,4] {
  %x = f32[16,8]{1,0} parameter(0)
  %w = f32[8,4]{1,0} parameter(1)
  %v = f32[4,16]{1,0} parameter(2)
  %ynn_fusion = f32[16,4]{1,0} fusion(%x, %w), kind=kCustom, calls=%fused_dot, metadata={op_name="jit(train_step)/transpose(jvp(projection))/dot_general"}
  %dot.2 = f32[16,16]{1,0} dot(%x, %x), lhs_contracting_dims={1}, rhs_contracting_dims={1}, metadata={op_name="jit(train_step)/lm_head/lora/dot_general"}
  %mul_fusion = f32[16,4]{1,0} fusion(%ynn_fusion), kind=kLoop, calls=%fused_mul, metadata={op_name="jit(train_step)/while/body/closed_call/checkpoint/rematted_computation/swiglu/mul"}
  %slice_fusion = f32[16,4]{1,0} fusion(%ynn_fusion), kind=kLoop, calls=%fused_mul, metadata={op_name="jit(train_step)/while/body/jit(dynamic_index_in_dim)/dynamic_slice"}
  %wrapped_broadcast.3 = f32[8,16,4]{2,1,0} fusion(), kind=kLoop, calls=%fused_mul, metadata={op_name="jit(train_step)/while/body/closed_call"}
  ROOT %add.1 = f32[16,4]{1,0} add(%mul_fusion, %slice_fusion), metadata={op_name="jit(train_step)/add"}
}
"""


def step_profile():
    sys.path.insert(0, str(ROOT / "bench"))
    import step_profile as module

    return module


def event(name: str, start: float, duration: float) -> dict:
    return {"ph": "X", "name": name, "ts": start, "dur": duration}


def test_each_instant_is_shared_among_the_ops_running_then_and_each_op_counts_under_its_innermost_part():
    module = step_profile()
    # two traced steps; times in microseconds. Step 1: the dot alone for 100, then the dot and the multiply
    # together for 50 (25 each), the multiply alone for 30, nothing for 20, then the rest one after another.
    events = [event("ynn_fusion", 0, 150), event("mul_fusion", 100, 80), event("dot.2", 200, 10),
              event("slice_fusion", 210, 40), event("wrapped_broadcast.3", 250, 60), event("add.1", 310, 2),
              event("ynn_fusion", 1000, 100), event("python_thing", 1000, 5000)]
    table = module.profile_table(events, HLO, steps=2)
    expected = {
        ("projection", "matmuls"): {"wall_ms": (125 + 100) / 2e3, "op_ms": 250 / 2e3,
                                    "matmul_gflop": 2 * 2 * 16 * 4 * 8 / 2e9},
        ("swiglu", "other ops"): {"wall_ms": 55 / 2e3, "op_ms": 80 / 2e3, "matmul_gflop": 0.0},
        ("lora", "matmuls"): {"wall_ms": 10 / 2e3, "op_ms": 10 / 2e3, "matmul_gflop": 2 * 16 * 16 * 8 / 2e9},
        ("layer scan", "other ops"): {"wall_ms": 40 / 2e3, "op_ms": 40 / 2e3, "matmul_gflop": 0.0},
        ("zero fill", "other ops"): {"wall_ms": 60 / 2e3, "op_ms": 60 / 2e3, "matmul_gflop": 0.0},
        ("other", "other ops"): {"wall_ms": 2 / 2e3, "op_ms": 2 / 2e3, "matmul_gflop": 0.0},
    }
    assert table["rows"].keys() == expected.keys()
    for key, row in expected.items():
        assert table["rows"][key] == pytest.approx(row, rel=1e-12, abs=0), key
    # the gaps (180-200 and 312-1000): no op running; the rows and the gaps make up the traced time
    assert table["idle_ms"] == pytest.approx((20 + 688) / 2e3)
    assert table["span_ms"] == pytest.approx(1100 / 2e3)
    assert sum(row["wall_ms"] for row in table["rows"].values()) + table["idle_ms"] == pytest.approx(table["span_ms"])


def test_a_trace_that_names_no_instruction_of_the_step_is_one_line():
    module = step_profile()
    with pytest.raises(SystemExit, match="^step_profile.py: no event of the trace names an instruction"):
        module.profile_table([event("sm90_xmma_gemm_kernel", 0, 10)], HLO, steps=1)


def test_a_device_trace_counts_its_kernels_by_their_hlo_op_and_not_the_hosts_launches(tmp_path):
    """A GPU-shaped trace: the host's row launches each instruction (an event named after it, as on the CPU) and the
    device's row runs it as a kernel named otherwise; only the kernels count, matched by their `hlo_op`."""
    import gzip

    module = step_profile()

    def on(pid, name, start, duration, hlo_op=None):
        return {**event(name, start, duration), "pid": pid, "tid": 1, "args": {"hlo_op": hlo_op} if hlo_op else {}}

    trace = {"traceEvents": [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:GPU:0"}},
        on(1, "ynn_fusion", 0, 5, "ynn_fusion"), on(1, "mul_fusion", 5, 5, "mul_fusion"),
        on(2, "sm90_xmma_gemm_f32f32_kernel", 10, 100, "ynn_fusion"),
        on(2, "loop_multiply_kernel", 110, 40, "mul_fusion"), on(2, "memcpy", 150, 10)]}
    directory = tmp_path / "plugins" / "profile" / "run"
    directory.mkdir(parents=True)
    with gzip.open(directory / "host.trace.json.gz", "wt") as f:
        json.dump(trace, f)
    table = module.profile_table(module.op_events(str(tmp_path)), HLO, steps=1)
    assert table["rows"] == {
        ("projection", "matmuls"): {"wall_ms": 0.1, "op_ms": 0.1, "matmul_gflop": 2 * 16 * 4 * 8 / 1e9},
        ("swiglu", "other ops"): {"wall_ms": 0.04, "op_ms": 0.04, "matmul_gflop": 0.0}}
    assert table["span_ms"] == pytest.approx(0.14) and table["idle_ms"] == 0


@pytest.mark.parametrize("args, named", [
    (["--steps", "0"], "--steps"),
    (["--layers", "two"], "--layers"),
    (["--seq", "0"], "--seq"),
    (["--attention", "flash"], "--attention"),
    (["--json", "/nonexistent-dir/profile.json"], "--json /nonexistent-dir/profile.json"),
    (["--json", "."], "--json ."),
])
@pytest.mark.slow
def test_bad_input_is_one_line_before_any_measuring(args, named):
    run = subprocess.run([sys.executable, "bench/step_profile.py", *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env=os.environ.copy(), check=False)
    assert run.returncode != 0
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("step_profile.py: error: ") and named in lines[0], run.stderr
    assert not run.stdout


@pytest.mark.slow
def test_the_real_steps_matmul_flops_per_part_are_the_models(tmp_path):
    from jaxmodel import scopes

    path, layers = tmp_path / "profile.json", 2  # with one layer, XLA drops its unused input gradients
    batch, seq = 2, 128  # not bench/train.py's 4 x 256: the options are the step's
    run = subprocess.run([sys.executable, "bench/step_profile.py", "--layers", str(layers), "--steps", "1", "--json",
                          str(path), "--batch", str(batch), "--seq", str(seq), "--attention", "blockwise"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600, env=os.environ.copy(), check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(path.read_text())
    assert (report["batch"], report["seq"], report["attention"]) == (batch, seq, "blockwise")
    sys.path.insert(0, str(ROOT / "bench"))
    from train import CONFIG, RANK

    tokens, d, f, v = batch * seq, CONFIG["hidden_size"], CONFIG["intermediate_size"], CONFIG["vocab_size"]
    q, kv = CONFIG["num_attention_heads"] * CONFIG["head_dim"], CONFIG["num_key_value_heads"] * CONFIG["head_dim"]
    shapes = [(d, q), (d, kv), (d, kv), (q, d), (d, f), (d, f), (f, d)]  # (in, out) of the seven projections
    parts = report["parts"]
    # frozen weights: the forward matmul and the input's gradient, no weight gradient
    assert parts["projection matmuls"]["matmul_gflop"] * 1e9 == pytest.approx(
        4 * tokens * layers * sum(i * o for i, o in shapes), rel=1e-12)
    # x A and (x A) B forward; B's, (x A)'s, A's and x's gradients backward
    assert parts["lora matmuls"]["matmul_gflop"] * 1e9 == pytest.approx(
        6 * tokens * layers * RANK * sum(i + o for i, o in shapes), rel=1e-12)
    assert parts["lm_head matmuls"]["matmul_gflop"] * 1e9 == pytest.approx(4 * tokens * v * d, rel=1e-12)
    assert parts["attention matmuls"]["matmul_gflop"] > 0
    for part in [*(p for p in scopes.PARTS if p not in scopes.EXPERT_PARTS), "layer scan"]:
        assert any(key.startswith(f"{part} ") and row["op_ms"] > 0 for key, row in parts.items()), part
    assert sum(row["wall_ms"] for row in parts.values()) + report["idle_ms"] == pytest.approx(report["traced_step_ms"])
    assert "| LoRA | matmuls |" in run.stdout and "MFU" in run.stdout


def test_an_experts_block_counts_as_the_experts_blocks_inside_a_projection_forward_and_backward():
    from finetune.planning.hlo_cost import parse_hlo

    module = step_profile()
    names = {"forward": "jit(train_step)/while/body/closed_call/projection/expert_block/cond/branch_1_fun/dot_general",
             "backward": "jit(train_step)/while/body/transpose(jvp(projection))/transpose(jvp(expert_block))/dot",
             "a scope inside it": "jit(train_step)/while/body/projection/expert_block/lora/dot_general"}
    for where, op_name in names.items():
        hlo = HLO.replace("jit(train_step)/transpose(jvp(projection))/dot_general", op_name)
        inst = parse_hlo(hlo).instructions["ynn_fusion"]
        assert module.part_of(inst, "ynn_fusion") == ("lora" if where == "a scope inside it" else "expert_block"), where
    assert module.label("expert_block") == "experts' blocks"
