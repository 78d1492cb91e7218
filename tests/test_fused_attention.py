"""The fused attention kernels (jaxmodel/fused_attention.py) as far as a CPU can run them: Pallas' Triton kernel in
Pallas' interpreter and cuDNN's call through `jax.nn.dot_product_attention`'s own XLA path with the same lengths,
each equal to the blockwise path (float32, 1e-5 of the largest entry) with grouped KV heads, padding and (Pallas)
packed documents; the refusals; the check a kernel passes before a run takes it; the kernel's output kept under
the dot policies; and the choice of a run's attention path (finetune/step/attention_choice.py)."""

import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxprs import count_eqns

from finetune.config import TrainConfig
from finetune.step.attention_choice import attention_call, choose_attention
from jaxmodel import fused_attention as fa
from jaxmodel.attention import attention, blockwise_attention
from jaxmodel.attention_check import AGREEMENT_FACTOR, disagreement, partial_attention
from jaxmodel.config import ModelConfig
from jaxmodel.matmul import DOT_POLICIES

B, T, N, K, H = 3, 160, 4, 2, 64  # T not a multiple of Pallas' block: the kernel's padding is exercised


def qkv(dtype=jnp.float32, t=T, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.normal(size=(B, t, heads, H)), dtype) for heads in (N, K, K))


def one_sequence_rows(t=T):
    """Each row one sequence and its padding: lengths t, 100, 1."""
    seg = np.zeros((B, t), np.int32)
    for row, length in enumerate((t, 100, 1)):
        seg[row, :length] = row + 1
    return jnp.asarray(seg)


def packed_rows(t=T):
    seg = np.asarray(one_sequence_rows(t)).copy()
    seg[0, 40:90], seg[0, 90:] = 7, 8  # three documents, no padding
    seg[1, 30:100] = 5  # two documents, then padding
    return jnp.asarray(seg)


def values_and_grads(fn, q, k, v, seg):
    cotangent = jnp.asarray(np.random.default_rng(9).normal(size=q.shape), jnp.float32)

    def loss(q, k, v):
        out = fn(q, k, v, seg)
        return jnp.sum(out.astype(jnp.float32) * cotangent), out

    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return [np.asarray(x, np.float32) for x in (out, *grads)]


def blockwise(q, k, v, seg):
    return blockwise_attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, scale=0.3)


def real_rows(seg):
    return (np.asarray(seg) != 0)[:, :, None, None]


def assert_close(got, want, rel=1e-5):
    np.testing.assert_allclose(got, want, rtol=rel, atol=rel * np.abs(want).max())


def test_pallas_triton_kernel_equals_the_blockwise_path_in_float32():
    """GQA repeated to the query heads, packed documents, padding, the sequence padded to the kernel's block, the
    scale: the interpreted kernel's output and gradients are the blockwise path's."""
    q, k, v = qkv()
    seg = packed_rows()
    kernel = lambda q, k, v, seg: fa.pallas_triton_attention(q, k, v, seg, seg, 0, None, 0.3) * real_rows(seg)
    for got, want in zip(values_and_grads(kernel, q, k, v, seg), values_and_grads(blockwise, q, k, v, seg)):
        assert_close(got, want)


def xla_cudnn(q, k, v, q_seg, kv_seg, q_offset, window, scale):
    """cuDNN's call on JAX's XLA path: the same arguments, lengths included."""
    return fa.cudnn_attention(q, k, v, q_seg, kv_seg, q_offset, window, scale, implementation="xla")


def test_cudnn_lengths_equal_the_blockwise_path_on_rows_of_one_sequence():
    q, k, v = qkv()
    seg = one_sequence_rows()
    kernel = lambda q, k, v, seg: xla_cudnn(q, k, v, seg, seg, 0, None, 0.3) * real_rows(seg)
    for got, want in zip(values_and_grads(kernel, q, k, v, seg), values_and_grads(blockwise, q, k, v, seg)):
        assert_close(got, want)


def test_cudnn_gives_nan_rows_where_a_row_is_not_one_sequence():
    """Packed documents and left padding cannot be lengths: those rows, and only those, are NaN."""
    q, k, v = qkv()
    seg = np.asarray(packed_rows()).copy()
    seg[2] = 0
    seg[2, 50:] = 4  # left padding
    out = np.asarray(xla_cudnn(q, k, v, jnp.asarray(seg), jnp.asarray(seg), 0, None, 0.3))
    assert np.isnan(out).all(axis=(1, 2, 3)).tolist() == [True, True, True]
    seg = np.asarray(one_sequence_rows())
    assert not np.isnan(np.asarray(xla_cudnn(q, k, v, jnp.asarray(seg), jnp.asarray(seg), 0, None, 0.3))).any()


def call(**changes):
    base = dict(dtype="bfloat16", head_dim=128, heads=32, kv_heads=8, q_len=2048, kv_len=2048, q_offset=False,
                window=False, packed=False)
    return fa.AttentionCall(**{**base, **changes})


@pytest.mark.parametrize("impl, changes, reason", [
    ("cudnn", dict(dtype="float32"), "bfloat16 or float16"),
    ("pallas-triton", dict(dtype="float32"), "bfloat16 or float16"),
    ("cudnn", dict(packed=True), "packed rows"),
    ("cudnn", dict(q_offset=True), "query offset"),
    ("pallas-triton", dict(q_offset=True), "query offset"),
    ("cudnn", dict(window=True), "sliding window"),
    ("pallas-triton", dict(window=True), "sliding window"),
    ("cudnn", dict(head_dim=256), "head_dim 256"),
    ("pallas-triton", dict(head_dim=100), "head_dim 100"),
    ("pallas-triton", dict(q_len=1024), "as many queries as keys"),
    ("pallas-flash", dict(dtype="float32"), "bfloat16 or float16"),
    ("pallas-flash", dict(head_dim=512), "head_dim 512"),
    ("pallas-flash", dict(heads=12, kv_heads=8), "12 query heads are not a multiple of 8 KV heads"),
])
def test_a_kernel_refuses_what_it_cannot_take(impl, changes, reason):
    assert fa.refusal(impl, call()) is None
    assert reason in fa.refusal(impl, call(**changes))


def test_pallas_takes_packed_rows_and_attention_raises_on_a_refused_call():
    assert fa.refusal("pallas-triton", call(packed=True, head_dim=256)) is None
    assert fa.refusal("pallas-flash", call(packed=True, q_offset=True, window=True, q_len=1024)) is None
    q, k, v = qkv(jnp.bfloat16)
    with pytest.raises(ValueError, match="pallas-triton cannot take this call: no sliding window"):
        attention(q, k, v, impl="pallas-triton", window=16)


def kernel_forwards(jaxpr, name: str) -> int:
    return count_eqns(jaxpr, lambda e: e.primitive.name == "pallas_call"
                      and str(e.params.get("name", "")).startswith(name))


@pytest.mark.parametrize("impl, forward", [("pallas-triton", "mha_forward"), ("pallas-flash", "flash_forward")])
@pytest.mark.parametrize("policy, forwards", [("dots", 1), ("full", 2)])
def test_remat_dots_keeps_the_kernels_output_and_runs_it_once(impl, forward, policy, forwards):
    """Under the dot policies the kernel's output and log-sum-exp are kept: the backward pass runs only the
    kernel's backward (o_proj's needs the output); a policy that keeps nothing runs the forward kernel again."""
    q, k, v = qkv(jnp.bfloat16, t=128)
    seg = jnp.ones((B, 128), jnp.int32)

    def loss(q, k, v):
        out = attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, impl=impl)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    kept = jax.checkpoint(loss, policy=DOT_POLICIES.get(policy, jax.checkpoint_policies.nothing_saveable))
    assert kernel_forwards(jax.make_jaxpr(jax.grad(kept, argnums=(0, 1, 2)))(q, k, v).jaxpr, forward) == forwards


@pytest.mark.parametrize("t, h", [(128, 64), (128, 80), (96, 64)])
def test_under_dots_pallas_flash_keeps_its_output_and_log_sum_exp_and_no_padded_copy(t, h, capsys):
    """What `--remat dots` keeps of the kernel: its output (as bits) and log-sum-exp, also where the kernel pads the
    sequence to whole blocks or head_dim to a power of two (padded copies of q, k, v or the output would be more)."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(1, t, heads, h)), jnp.bfloat16) for heads in (N, K, K))
    seg = jnp.ones((1, t), jnp.int32)

    def loss(q, k, v):
        out = attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, impl="pallas-flash")
        return jnp.sum(out.astype(jnp.float32) ** 2)

    jax.ad_checkpoint.print_saved_residuals(jax.checkpoint(loss, policy=DOT_POLICIES["dots"]), q, k, v)
    kept = re.findall(r"(\w+\[[\d,]+\]) named 'batched_dot'", capsys.readouterr().out)
    padded_t = -(-t // 64) * 64
    assert sorted(kept) == [f"f32[1,{N},{padded_t}]", f"u16[1,{t},{N},{h}]"]


def test_the_check_takes_an_agreeing_kernel_and_says_why_it_refuses_others():
    packed = call(heads=4, kv_heads=2, head_dim=64, packed=True)
    assert disagreement("pallas-triton", packed) is None
    unpacked = dataclass_replace(packed, packed=False)
    stand_in = partial_attention("cudnn")
    with KernelStandIn("cudnn", attend=xla_cudnn):
        assert disagreement("cudnn", unpacked) is None
        assert "output is off the float32 reference by nan" in disagreement("cudnn", packed, stand_in)

    def scaled(q, k, v, **segments):  # an error a few times the bound
        out = blockwise_attention(q, k, v, **segments)
        return (out.astype(jnp.float32) * (1 + 2 ** -5)).astype(out.dtype)

    assert "its output is off" in disagreement("pallas-triton", packed, scaled)

    def raises(*args, **kwargs):
        raise RuntimeError("no execution plans\nmore")

    assert disagreement("cudnn", unpacked, raises) == "RuntimeError: no execution plans"


def test_the_check_takes_the_runs_query_offset_and_window():
    """A cp run's kernel is checked at an offset, a windowed family's with a window: a kernel that drops either is
    not taken."""
    cp_windowed = call(heads=4, kv_heads=2, head_dim=64, packed=True, q_offset=True, window=True)
    assert disagreement("pallas-flash", cp_windowed) is None

    def offset_dropped(q, k, v, *, q_offset, **rest):
        return blockwise_attention(q, k, v, **rest)

    def window_dropped(q, k, v, *, window, **rest):
        return blockwise_attention(q, k, v, **rest)

    for dropped in (offset_dropped, window_dropped):
        assert "its output is off" in disagreement("pallas-flash", cp_windowed, dropped)


def flash_attn_func_stand_in(q, k, v, *, softmax_scale, causal):
    """`jax_aiter.mha.flash_attn_func`'s documented semantics on JAX's XLA path: grouped KV heads as they are, a
    causal mask aligned bottom-right (with as many queries as keys, the usual one)."""
    assert causal and q.shape[1] == k.shape[1]
    return jax.nn.dot_product_attention(q, k, v, scale=softmax_scale, is_causal=True, implementation="xla")


def xla_aiter(q, k, v, q_seg, kv_seg, q_offset, window, scale):
    return fa.aiter_attention(q, k, v, q_seg, kv_seg, q_offset, window, scale,
                              flash_attn_func=flash_attn_func_stand_in)


def test_aiter_equals_the_blockwise_path_on_rows_of_one_sequence_and_is_nan_on_others():
    """AMD's kernel (untested on a ROCm machine) through a stand-in with its documented semantics: rows of one
    sequence and their padding as the blockwise path; a packed row NaN."""
    q, k, v = qkv()
    seg = one_sequence_rows()
    kernel = lambda q, k, v, seg: xla_aiter(q, k, v, seg, seg, 0, None, 0.3) * real_rows(seg)
    for got, want in zip(values_and_grads(kernel, q, k, v, seg), values_and_grads(blockwise, q, k, v, seg)):
        assert_close(got, want)
    packed = packed_rows()
    out = np.asarray(xla_aiter(q, k, v, packed, packed, 0, None, 0.3))
    assert np.isnan(out).all(axis=(1, 2, 3)).tolist() == [True, True, False]
    with KernelStandIn("aiter", attend=xla_aiter):
        assert disagreement("aiter", call(heads=4, kv_heads=2, head_dim=64, packed=False)) is None


@pytest.mark.parametrize("platform, version, kernels_of", [
    ("gpu", "cuda 12080", "cuda"), ("gpu", "rocm 60302", "rocm"), ("cpu", "cpu", "cpu")])
def test_a_gpu_is_told_nvidia_or_amd_by_its_platform_version(platform, version, kernels_of):
    """JAX names both GPUs "gpu": the client's platform version says whose kernels it may run."""
    import types

    device = types.SimpleNamespace(platform=platform, client=types.SimpleNamespace(platform_version=version))
    assert fa.kernel_platform(device) == kernels_of


def dataclass_replace(x, **changes):
    import dataclasses

    return dataclasses.replace(x, **changes)


class KernelStandIn:
    """Kernel `impl`'s fields (`attend`, `refusal`) replaced by `changes` while inside."""

    def __init__(self, impl, **changes):
        self.impl, self.changes = impl, changes

    def __enter__(self):
        self.kept = fa.KERNELS[self.impl]
        fa.KERNELS[self.impl] = dataclass_replace(self.kept, **self.changes)

    def __exit__(self, *exc):
        fa.KERNELS[self.impl] = self.kept


LLAMA = ModelConfig(vocab_size=64, hidden_size=256, intermediate_size=64, num_hidden_layers=1,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64)


def run(**options):
    return TrainConfig(**{"model": "m", "data": "d", "out": "o", "seq_len": 2048, "dtype": "bfloat16", **options})


def agree(impl, call):
    return None


@pytest.mark.parametrize("options, cp, platform, impl, said", [
    ({}, 1, "cpu", "blockwise", "attention: blockwise (auto on cpu)"),
    (dict(seq_len=256), 1, "cpu", "xla", "attention: xla (auto on cpu)"),
    (dict(attention="xla"), 1, "cuda", "xla", "attention: xla (--attention)"),
    (dict(pack=False), 1, "cuda", "cudnn", "attention: cudnn (agrees with the portable path"),
    ({}, 1, "cuda", "pallas-triton", "attention: pallas-triton (agrees"),
    ({}, 2, "cuda", "pallas-flash", "attention: pallas-flash (agrees"),
    (dict(dtype="float32"), 2, "cuda", "blockwise", "auto takes blockwise; not taken: cudnn: rows of one sequence "
     "each (padding as lengths): packed rows (--pack) need segments; pallas-triton: computes in bfloat16"),
    (dict(attention="cudnn"), 1, "cuda", "blockwise", "blockwise serves the run; not taken: cudnn: rows of one"),
    (dict(attention="pallas-triton", dtype="float32"), 1, "cuda", "blockwise",
     "not taken: pallas-triton: computes in bfloat16 or float16, not float32"),
    (dict(pack=False), 1, "rocm", "aiter", "attention: aiter (agrees"),
    ({}, 1, "rocm", "pallas-flash", "attention: pallas-flash (agrees"),
    (dict(attention="aiter"), 1, "cuda", "blockwise", "not taken: aiter: not a kernel for cuda"),
])
def test_a_run_takes_the_first_kernel_that_can_take_it_and_agrees(options, cp, platform, impl, said):
    choice = choose_attention(run(**options), LLAMA, cp, platform=platform, check=agree)
    assert choice.impl == impl
    assert said in choice.why
    # a run prints its line where a kernel was weighed: on an NVIDIA GPU, or a kernel named
    assert choice.weighed == (platform in ("cuda", "rocm") and options.get("attention") != "xla")


def test_the_option_offers_every_attention_path_and_plan_stands_in_for_each_kernel():
    """`--attention`'s choices are the model's paths (the config module does not import JAX to list them); `--plan`,
    which compiles no GPU kernel, takes the blockwise path for each kernel."""
    import typing

    from jaxmodel.attention import ATTENTION_IMPLS

    assert typing.get_args(typing.get_type_hints(TrainConfig)["attention"]) == ("auto", *ATTENTION_IMPLS)
    assert {run(attention=impl).attention_impl() for impl in fa.FUSED_IMPLS} == {"blockwise"}


def test_a_kernel_that_disagrees_is_not_taken_and_the_line_says_why():
    said = {}
    check = lambda impl, call: said.setdefault(impl, f"{impl} is off")
    choice = choose_attention(run(pack=False), LLAMA, 1, platform="cuda", check=check)
    assert (choice.impl, list(said)) == ("blockwise", ["cudnn", "pallas-triton", "pallas-flash"])
    assert choice.why == ("attention: auto takes blockwise; not taken: cudnn: cudnn is off; "
                          "pallas-triton: pallas-triton is off; pallas-flash: pallas-flash is off")


def test_a_windowed_family_and_context_parallel_calls_are_said_so():
    windowed = dataclass_replace(LLAMA, sliding_window=512, sliding_layers=(True,))
    assert attention_call(run(), windowed, 1).window
    assert attention_call(run(), LLAMA, 2) == fa.AttentionCall("bfloat16", 64, 4, 2, 1024, 2048, True, False, True)


@pytest.mark.parametrize("others, impl", [((1,), "pallas-triton"), ((0,), "blockwise")])
def test_every_process_takes_the_same_attention(monkeypatch, others, impl):
    """A process whose check came out otherwise makes every process take the portable path."""
    from jax.experimental import multihost_utils

    from finetune.step import attention_choice

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(multihost_utils, "process_allgather", lambda mine: np.asarray([mine, *others]))
    choice = attention_choice.agreed(attention_choice.AttentionChoice("pallas-triton", "attention: pallas-triton"),
                                     "blockwise")
    assert choice.impl == impl
    if impl == "blockwise":
        assert choice.why == "attention: blockwise (the processes' checks differed: ['cudnn', 'pallas-triton'])"


@pytest.mark.slow
def test_two_processes_whose_checks_differ_both_take_the_portable_path(tmp_path):  # xla at 256 positions
    """Two real processes joined over loopback: process 1's check refuses the Pallas kernel that process 0's
    takes; both take the portable path, and say why."""
    from isolation import run_processes

    run_processes("attention_choice_worker.py", [str(tmp_path)], [])
    choices = [json.loads((tmp_path / f"choice-{i}.json").read_text()) for i in range(2)]
    assert choices[0] == choices[1] == {
        "impl": "xla", "why": "attention: xla (the processes' checks differed: ['pallas-triton', 'xla'])"}


def run_grads(tiny_converted, tmp_path, attention, dtype, mesh="dp=2,fsdp=1,mp=1"):
    """A run's setup (`finetune.train.build.setup`) on two devices and its loss and LoRA gradients on a batch of
    packed rows with padding, and what the run printed."""
    from flax import nnx
    from test_context_parallel import write_packed_data

    from finetune.data.order import row_indices
    from finetune.step.train_step import loss_and_grads
    from finetune.train.build import setup
    from finetune.train.loop import global_batch

    config = TrainConfig(model=str(tiny_converted), data=str(write_packed_data(tmp_path / "train.jsonl")),
                         out=str(tmp_path / attention / dtype), mesh=mesh, steps=1, batch_size=4,
                         seq_len=32, dtype=dtype, attention=attention, progress=False).validate()
    run = setup(config, devices=jax.devices()[:2])
    lora = jax.tree.map(lambda x: x + 0.01 * jax.random.normal(jax.random.key(1), x.shape, x.dtype), run.state.lora)
    with jax.set_mesh(run.mesh):
        batch = global_batch(run.train_rows, lambda lo, hi: row_indices(len(run.train_rows), 0, 0, 4, lo, hi),
                             run.batch_sharding, 4)
        loss, _, grads = jax.jit(lambda lora, base, batch: loss_and_grads(run.graphdef, lora, base, batch))(
            lora, run.base, batch)
    return run.model.attention, [np.float32(loss)] + [np.asarray(v[...], np.float32)
                                                      for _, v in nnx.to_flat_state(grads)]


@pytest.mark.slow
@pytest.mark.parametrize("kernel_name, mesh", [("pallas-triton", "dp=2,fsdp=1,mp=1"),
                                               ("pallas-flash", "dp=1,fsdp=1,mp=1,cp=2")])
def test_a_run_named_to_a_kernel_checks_it_says_so_and_trains_within_the_bound(tiny_converted, tmp_path, capsys,
                                                                                kernel_name, mesh):
    """`--attention pallas-triton`, and `pallas-flash` with cp (interpreted on a CPU): the check passes, the run's
    first lines say so, and its loss and LoRA gradients are as far from the float32 run as the blockwise path's in
    bf16, within the check's factor."""
    impl, kernel = run_grads(tiny_converted, tmp_path, kernel_name, "bfloat16", mesh)
    assert impl == kernel_name
    assert f"finetune-lora: attention: {kernel_name} (agrees with the portable path on a check of this run's heads " \
        "in bfloat16)" in capsys.readouterr().err
    _, portable = run_grads(tiny_converted, tmp_path, "blockwise", "bfloat16", mesh)
    _, reference = run_grads(tiny_converted, tmp_path, "blockwise", "float32", mesh)
    for got, port, want in zip(kernel, portable, reference):
        scale = np.abs(want).max()
        assert np.abs(got - want).max() <= AGREEMENT_FACTOR * max(np.abs(port - want).max(), 1e-3 * scale)
