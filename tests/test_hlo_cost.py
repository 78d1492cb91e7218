"""finetune/planning/hlo_cost.py: FLOPs, bytes and collectives of a compiled step, loops counted as often as they
run, on a written module whose every count is known, and on compiled train steps whose collectives each layout
implies (8 simulated devices)."""

import pytest

from finetune.planning.hlo_cost import bus_factor, group_size, parse_hlo, step_cost

# A step with an outer loop of 3 and an inner loop of 2 inside it; the inner body runs a [4,8]x[8,16] dot (1,024
# FLOPs) 6 times and slices one [16] row of a [3,16] buffer it also updates in place; the outer body gathers a
# [2,16] bf16 operand to [16,16] (async pair) and all-reduces a tuple of two arrays (iota groups of 4); the entry
# reduce-scatters a [64] float32 buffer over list groups of 8, once.
MODULE = """HloModule jit_step, entry_computation_layout={()->f32[]}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

%fused_slice (param_0: f32[3,16], param_1: s32[]) -> f32[1,16] {
  %param_0 = f32[3,16]{1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  ROOT %ds = f32[1,16]{1,0} dynamic-slice(%param_0, %param_1, %zero), dynamic_slice_sizes={1,16}
}

%fused_update (param_0.1: f32[3,16], param_1.1: f32[1,16], param_2.1: s32[]) -> f32[3,16] {
  %param_0.1 = f32[3,16]{1,0} parameter(0)
  %param_1.1 = f32[1,16]{1,0} parameter(1)
  %param_2.1 = s32[] parameter(2)
  %zero.1 = s32[] constant(0)
  ROOT %dus = f32[3,16]{1,0} dynamic-update-slice(%param_0.1, %param_1.1, %param_2.1, %zero.1)
}

%inner_body (p: (s32[], f32[4,8], f32[8,16], f32[3,16])) -> (s32[], f32[4,8], f32[8,16], f32[3,16]) {
  %p = (s32[], f32[4,8]{1,0}, f32[8,16]{1,0}, f32[3,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %a = f32[4,8]{1,0} get-tuple-element(%p), index=1
  %b = f32[8,16]{1,0} get-tuple-element(%p), index=2
  %buf = f32[3,16]{1,0} get-tuple-element(%p), index=3
  %d = f32[4,16]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/dot_general"}
  %row = f32[1,16]{1,0} fusion(%buf, %i), kind=kLoop, calls=%fused_slice
  %new = f32[3,16]{1,0} fusion(%buf, %row, %i), kind=kLoop, calls=%fused_update
  ROOT %t = (s32[], f32[4,8]{1,0}, f32[8,16]{1,0}, f32[3,16]{1,0}) tuple(%i, %a, %b, %new)
}

%inner_cond (q: (s32[], f32[4,8], f32[8,16], f32[3,16])) -> pred[] {
  %q = (s32[], f32[4,8]{1,0}, f32[8,16]{1,0}, f32[3,16]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

%outer_body (r: (s32[], bf16[2,16], f32[4,8], f32[8,16], f32[3,16])) -> (s32[], bf16[2,16], f32[4,8], f32[8,16], f32[3,16]) {
  %r = (s32[], bf16[2,16]{1,0}, f32[4,8]{1,0}, f32[8,16]{1,0}, f32[3,16]{1,0}) parameter(0)
  %j = s32[] get-tuple-element(%r), index=0
  %w = bf16[2,16]{1,0} get-tuple-element(%r), index=1
  %a.1 = f32[4,8]{1,0} get-tuple-element(%r), index=2
  %b.1 = f32[8,16]{1,0} get-tuple-element(%r), index=3
  %buf.1 = f32[3,16]{1,0} get-tuple-element(%r), index=4
  %ags = (bf16[2,16]{1,0}, bf16[16,16]{1,0}) all-gather-start(%w), channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}, use_global_device_ids=true, metadata={op_name="jit(step)/gather"}
  %agd = bf16[16,16]{1,0} all-gather-done(%ags)
  %ar = (f32[4,8]{1,0}, f32[8,16]{1,0}) all-reduce(%a.1, %b.1), channel_id=2, replica_groups=[2,4]<=[8], to_apply=%add
  %a.2 = f32[4,8]{1,0} get-tuple-element(%ar), index=0
  %b.2 = f32[8,16]{1,0} get-tuple-element(%ar), index=1
  %init = (s32[], f32[4,8]{1,0}, f32[8,16]{1,0}, f32[3,16]{1,0}) tuple(%j, %a.2, %b.2, %buf.1)
  %inner = (s32[], f32[4,8]{1,0}, f32[8,16]{1,0}, f32[3,16]{1,0}) while(%init), condition=%inner_cond, body=%inner_body, backend_config={"known_trip_count":{"n":"2"}}
  %buf.2 = f32[3,16]{1,0} get-tuple-element(%inner), index=3
  ROOT %u = (s32[], bf16[2,16]{1,0}, f32[4,8]{1,0}, f32[8,16]{1,0}, f32[3,16]{1,0}) tuple(%j, %w, %a.2, %b.2, %buf.2)
}

%outer_cond (s: (s32[], bf16[2,16], f32[4,8], f32[8,16], f32[3,16])) -> pred[] {
  %s = (s32[], bf16[2,16]{1,0}, f32[4,8]{1,0}, f32[8,16]{1,0}, f32[3,16]{1,0}) parameter(0)
  ROOT %c.1 = pred[] constant(true)
}

ENTRY %main (arg0: bf16[2,16], arg1: f32[4,8], arg2: f32[8,16], arg3: f32[3,16], arg4: f32[64]) -> f32[8] {
  %arg0 = bf16[2,16]{1,0} parameter(0)
  %arg1 = f32[4,8]{1,0} parameter(1)
  %arg2 = f32[8,16]{1,0} parameter(2)
  %arg3 = f32[3,16]{1,0} parameter(3)
  %arg4 = f32[64]{0} parameter(4)
  %zero.2 = s32[] constant(0)
  %start = (s32[], bf16[2,16]{1,0}, f32[4,8]{1,0}, f32[8,16]{1,0}, f32[3,16]{1,0}) tuple(%zero.2, %arg0, %arg1, %arg2, %arg3)
  %loop = (s32[], bf16[2,16]{1,0}, f32[4,8]{1,0}, f32[8,16]{1,0}, f32[3,16]{1,0}) while(%start), condition=%outer_cond, body=%outer_body, backend_config={"known_induction_variable":{"tuple_index":"0"},"known_trip_count":{"n":"3"}}
  ROOT %rs = f32[8]{0} reduce-scatter(%arg4), channel_id=3, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, to_apply=%add
}
"""


def test_loops_multiply_their_bodies_counts():
    cost = step_cost(MODULE, devices=8)
    assert cost.flops == 6 * 2 * 4 * 16 * 8
    assert cost.unknown_trip_counts == []
    totals = cost.collective_totals()
    assert totals["all-gather"] == {"bytes": 3 * 16 * 16 * 2, "count": 3, "group_size": 8}
    assert totals["all-reduce"] == {"bytes": 3 * (4 * 8 + 8 * 16) * 4, "count": 3, "group_size": 4}
    assert totals["reduce-scatter"] == {"bytes": 64 * 4, "count": 1, "group_size": 8}


def test_slices_and_in_place_updates_count_what_they_touch():
    cost = step_cost(MODULE, devices=8)
    row = 16 * 4
    dot = 4 * 8 * 4 + 8 * 16 * 4 + 4 * 16 * 4
    # each inner step: the dot's operands and output, the slice (the row read, the row written, the index), the
    # update (the row read and written in place, the row operand read, the index); the [3,16] buffer never whole
    inner = dot + (row + row + 4) + (2 * row + row + 4)
    # each outer step: the all-gather's operand and output and the all-reduce's operands and output
    outer = (2 * 16 * 2 + 16 * 16 * 2) + 2 * (4 * 8 + 8 * 16) * 4
    assert cost.bytes == 6 * inner + 3 * outer + (64 * 4 + 8 * 4)


def test_a_loop_without_a_known_trip_count_counts_once_and_is_named():
    cost = step_cost(MODULE.replace(',"known_trip_count":{"n":"3"}', ""), devices=8)
    assert cost.unknown_trip_counts == ["loop"]
    assert cost.flops == 2 * 2 * 4 * 16 * 8


# XLA:CPU's 16-bit collectives: an all-reduce promoted to float32, and a gather of weights converted to float32 first
CPU_16BIT = """HloModule jit_step

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%add_promoted (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

%fused_up (param_0: bf16[4,16]) -> f32[4,16] {
  %param_0 = bf16[4,16]{1,0} parameter(0)
  ROOT %c = f32[4,16]{1,0} convert(%param_0)
}

ENTRY %main (w: bf16[4,16], g: f32[4,16]) -> (f32[32,16], f32[4,16], f32[4,16]) {
  %w = bf16[4,16]{1,0} parameter(0)
  %g = f32[4,16]{1,0} parameter(1)
  %up = f32[4,16]{1,0} fusion(%w), kind=kLoop, calls=%fused_up
  %ag = f32[32,16]{1,0} all-gather(%up), replica_groups=[1,8]<=[8], dimensions={0}
  %ar = f32[4,16]{1,0} all-reduce(%up), replica_groups=[1,8]<=[8], to_apply=%add_promoted
  %ar.1 = f32[4,16]{1,0} all-reduce(%g), replica_groups=[1,8]<=[8], to_apply=%add_promoted
  %ar.2 = f32[4,16]{1,0} all-reduce(%g), replica_groups=[1,8]<=[8], to_apply=%add
  ROOT %t = (f32[32,16]{1,0}, f32[4,16]{1,0}, f32[4,16]{1,0}) tuple(%ag, %ar, %ar.2)
}
"""


def test_a_cpu_compiled_16bit_step_counts_what_it_upcast_at_16_bits():
    sizes = {c.name: c.bytes for c in step_cost(CPU_16BIT, devices=8, cpu_16bit=True).collectives}
    assert sizes == {"ag": 32 * 16 * 2, "ar": 4 * 16 * 2, "ar.1": 4 * 16 * 2, "ar.2": 4 * 16 * 4}
    as_compiled = {c.name: c.bytes for c in step_cost(CPU_16BIT, devices=8).collectives}
    assert as_compiled == {"ag": 32 * 16 * 4, "ar": 4 * 16 * 4, "ar.1": 4 * 16 * 4, "ar.2": 4 * 16 * 4}


@pytest.mark.parametrize("attributes, size", [
    ("replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}", 4),
    ("replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}", 2),
    ("replica_groups=[1,8]<=[8]", 8),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, dimensions={1}", 4),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=2,'axis_2'=2] {'axis_0','axis_2'}", 4),
    ("replica_groups={}, dimensions={0}", 8),
    ("source_target_pairs={{0,1},{1,2}}", 2),
])
def test_replica_groups_in_each_form(attributes, size):
    assert group_size(attributes, devices=8) == size


def test_bus_factors_are_nccl_tests():
    assert bus_factor("all-reduce", 8) == 2 * 7 / 8
    assert bus_factor("all-gather", 8) == bus_factor("reduce-scatter", 8) == bus_factor("all-to-all", 8) == 7 / 8
    assert bus_factor("collective-permute", 2) == 1.0


def test_parsed_instructions_keep_their_operands_and_called_computations():
    module = parse_hlo(MODULE)
    assert module.entry == "main"
    loop = module.computations["main"]["loop"]
    assert loop.called == {"condition": ["outer_cond"], "body": ["outer_body"]}
    assert module.computations["outer_body"]["ar"].operands == ["a.1", "b.1"]
    assert module.computations["inner_body"]["t"].root


def test_a_conditional_under_a_scope_with_a_share_counts_its_true_branch_that_share_of_its_runs():
    """A loop of 8 whose conditional runs a [16,32]x[32,64] dot while the index is below a traced bound: with the
    share of its scope (a grouped matmul's blocks, jaxmodel/moe.py) the dot counts that share of 8 times, without
    it every time (each branch counted at each run)."""
    import jax
    import jax.numpy as jnp

    from jaxmodel import scopes

    def step(x, w, used):
        def body(i, acc):
            with jax.named_scope(scopes.EXPERT_BLOCK):
                return acc + jax.lax.cond(i < used, lambda: jnp.sum(x @ w), lambda: 0.0)
        return jax.lax.fori_loop(0, 8, body, 0.0)

    text = jax.jit(step).lower(jnp.ones((16, 32)), jnp.ones((32, 64)), 3).compile().as_text()
    dot = 2 * 16 * 32 * 64
    assert step_cost(text, devices=1).flops == 8 * dot
    assert step_cost(text, devices=1, shares={scopes.EXPERT_BLOCK: 0.25}).flops == 2 * dot
    assert step_cost(text, devices=1, shares={"another_scope": 0.25}).flops == 8 * dot
    # a remat'ed conditional's gradient too, its scope named under the transformations (jvp(expert_block))
    def once(x, w, used):
        with jax.named_scope(scopes.EXPERT_BLOCK):
            return jax.lax.cond(used > 0, lambda: jnp.sin(x @ w), lambda: jnp.zeros((16, 64)))

    grad = jax.jit(jax.grad(lambda x, w, used: jnp.sum(jax.checkpoint(once)(x, w, used) ** 2))).lower(
        jnp.ones((16, 32)), jnp.ones((32, 64)), 3).compile().as_text()
    assert "jvp(expert_block)/cond" in grad
    every = step_cost(grad, devices=1).flops
    assert every >= 3 * dot and step_cost(grad, devices=1, shares={scopes.EXPERT_BLOCK: 0.25}).flops == every / 4


def test_a_loop_without_a_known_trip_count_runs_as_often_as_told():
    """A sampler's decode loop ends when every row has stopped: a plan counts it at its most."""
    cost = step_cost(MODULE.replace(',"known_trip_count":{"n":"3"}', ""), devices=8, unknown_trips=5)
    assert cost.unknown_trip_counts == []
    assert cost.flops == 5 * 2 * 2 * 4 * 16 * 8  # 5 outer trips, the inner loop's 2 each
