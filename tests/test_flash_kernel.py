"""This package's Pallas flash attention (jaxmodel/flash_kernel.py) as far as a CPU can run it: in Pallas'
interpreter, its output and gradients equal the blockwise path's (float32, 1e-5 of the largest entry) with query
offsets, query and key segment ids apart, grouped KV heads, windows and padding to whole blocks, also as
context parallelism's attention over a `cp` mesh; and its three kernels lower to Triton for a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_fused_attention import KernelStandIn

from jaxmodel.attention import blockwise_attention
from jaxmodel.context_parallel import context_parallel_attention, cp_order
from jaxmodel.flash_kernel import NO_WINDOW, _key_blocks, _query_blocks, flash_attention


def rows(b, s, seed=0):
    """Segment ids `[b, s]`: row 0 three documents and padding, row 1 one document and padding, further rows one
    document each."""
    seg = np.ones((b, s), np.int32)
    seg[0, s // 3:], seg[0, s // 2:], seg[0, s - s // 8:] = 2, 3, 0
    if b > 1:
        seg[1, s - s // 5:] = 0
    return jnp.asarray(seg)


def arrays(b, t, s, n, k, h, seed=0):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in
            ((b, t, n, h), (b, s, k, h), (b, s, k, h), (b, t, n, h))]


def values_and_grads(fn, q, k, v, cotangent):
    def loss(q, k, v):
        out = fn(q, k, v)
        return jnp.sum(out * cotangent), out

    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return [np.asarray(x) for x in (out, *grads)]


def assert_same(got, want, rel=1e-5):
    for name, g, w in zip(("output", "dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(g, w, rtol=0, atol=rel * np.abs(w).max(), err_msg=name)


@pytest.mark.parametrize("t, s, offset, n, k, h, window", [
    (160, 160, 0, 4, 2, 64, None),  # self-attention, padded to whole blocks
    (96, 160, 64, 4, 2, 64, None),  # a chunk's queries at an offset: fewer queries than keys
    (96, 160, 64, 4, 1, 32, 40),  # a window, reaching back over block bounds; four query heads a KV head
    (64, 192, 100, 6, 2, 80, 70),  # an offset within a block, three query heads a KV head, head_dim padded
    (48, 24, 0, 4, 2, 32, None),  # more queries than keys
    (16, 160, 144, 4, 2, 64, None),  # row 0's queries all padding
])
def test_the_kernel_equals_the_blockwise_path_in_float32(t, s, offset, n, k, h, window):
    q, key, v, cotangent = arrays(2, t, s, n, k, h)
    seg = rows(2, max(s, offset + t))  # the positions of queries and keys
    kv_seg, q_seg = seg[:, :s], seg[:, offset:offset + t]
    real = (np.asarray(q_seg) != 0)[:, :, None, None]
    kernel = lambda q, k, v: flash_attention(q, k, v, q_seg, kv_seg, offset, window, scale=0.3) * real
    blockwise = lambda q, k, v: blockwise_attention(q, k, v, q_segment_ids=q_seg, kv_segment_ids=kv_seg,
                                                    q_offset=offset, window=window, scale=0.3)
    assert_same(values_and_grads(kernel, q, key, v, cotangent), values_and_grads(blockwise, q, key, v, cotangent))


@pytest.mark.parametrize("block_q, block_kv", [(16, 32), (32, 16)])
def test_each_program_walks_exactly_the_blocks_that_hold_a_visible_pair(block_q, block_kv):
    """By index (the segments aside): a query block walks the key blocks, and a key block (dK/dV) the query blocks,
    holding at least one pair within the causal window, and no other."""
    for offset in (0, 5, 64, 100):
        for window in (1, 3, 40, NO_WINDOW):
            for t, s in ((16, 64), (96, 160), (64, 48)):
                q_blocks, kv_blocks = -(-t // block_q), -(-s // block_kv)
                distance = offset + np.arange(q_blocks * block_q)[:, None] - np.arange(kv_blocks * block_kv)[None, :]
                visible = ((distance >= 0) & (distance < window)).reshape(q_blocks, block_q, kv_blocks, block_kv)
                pairs = visible.any(axis=(1, 3))  # [query block, key block]
                for i in range(q_blocks):
                    lo, hi = _key_blocks(offset + i * block_q, block_q, window, block_kv, kv_blocks)
                    assert list(range(int(lo), int(hi))) == np.flatnonzero(pairs[i]).tolist(), (offset, window, t, s)
                for j in range(kv_blocks):
                    lo, hi = _query_blocks(j * block_kv, block_kv, offset, window, block_q, q_blocks)
                    assert list(range(int(lo), int(hi))) == np.flatnonzero(pairs[:, j]).tolist(), (offset, window, j)


def test_a_traced_offset_and_window_are_the_static_ones():
    """Under jit, as a layer scan's window and a cp device's chunk give them."""
    q, k, v, _ = arrays(1, 64, 128, 2, 1, 32)
    seg = rows(1, 128)
    want = flash_attention(q, k, v, seg[:, 64:], seg, 64, 30, scale=0.2)
    got = jax.jit(lambda offset, window: flash_attention(q, k, v, seg[:, 64:], seg, offset, window, scale=0.2))(
        jnp.int32(64), jnp.int32(30))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("cp, window", [(2, None), (4, 40)])
def test_under_cp_the_kernel_equals_the_blockwise_path(cp, window):
    """Each device's two chunks at their offsets (chunks of 24 or 12 positions: offsets within the kernel's blocks)
    against the all-gathered keys; the whole attention and its gradients as one device's blockwise path."""
    t = 96
    q, k, v, cotangent = arrays(2, t, t, 4, 2, 32)
    seg = rows(2, t)
    order = cp_order(t, cp)
    mesh = jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp], axis_types=(jax.sharding.AxisType.Auto,))

    def under_cp(q, k, v):
        out = context_parallel_attention(q[:, order], k[:, order], v[:, order], segment_ids_bt=seg[:, order],
                                         impl="pallas-flash", window=window, scale=0.3)
        return jnp.zeros_like(out).at[:, order].set(out) * real  # back to the original order

    real = (np.asarray(seg) != 0)[:, :, None, None]
    one_device = lambda q, k, v: blockwise_attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, window=window,
                                                     scale=0.3)
    want = values_and_grads(one_device, q, k, v, cotangent)
    # pallas-flash offered float32 calls (a GPU run's kernel computes in 16 bits; the equality wants float32's bound)
    with KernelStandIn("pallas-flash", refusal=lambda call: None), jax.set_mesh(mesh):
        got = values_and_grads(under_cp, q, k, v, cotangent)
    assert_same(got, want)


def triton_calls(text: str) -> int:
    return text.count("stablehlo.custom_call @__gpu$xla.gpu.triton")


@pytest.mark.parametrize("t, s, n, k, h", [(128, 256, 8, 2, 128), (100, 300, 6, 2, 80), (128, 128, 4, 1, 256)])
def test_the_kernels_lower_to_triton_for_a_gpu(t, s, n, k, h):
    """Forward, dQ and dK/dV lower to Triton calls on a CPU-only machine (jax.jit's lowering for "cuda"): every
    operation the kernels use has a Triton lowering, with a traced offset and window, grouped heads whose group is
    not a power of two, lengths padded to whole blocks, a head_dim padded to a power of two and Gemma's 256. (Triton's
    own compilation, its registers and shared memory, happen on the GPU: the check before a run takes the kernel is
    what meets a failure there.)"""
    q = jax.ShapeDtypeStruct((2, t, n, h), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, s, k, h), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((2, t), jnp.int32), jax.ShapeDtypeStruct((2, s), jnp.int32)
    scalar = jax.ShapeDtypeStruct((), jnp.int32)

    def loss(q, k, v, q_seg, kv_seg, offset, window):
        out = flash_attention(q, k, v, q_seg, kv_seg, offset, window, scale=0.1, interpret=False)
        return jnp.sum(out.astype(jnp.float32))

    forward = jax.jit(loss).trace(q, kv, kv, *seg, scalar, scalar).lower(lowering_platforms=("cuda",))
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv, *seg, scalar, scalar).lower(
        lowering_platforms=("cuda",))
    assert (triton_calls(forward.as_text()), triton_calls(grads.as_text())) == (1, 3)
