"""Attention: the blockwise path equals the plain one (outputs and q/k/v gradients, float32, 1e-5 of the
largest entry) over drawn shapes, GQA ratios, block sizes, packed documents, padding and query offsets;
sliding windows; padding rows give zeros and no gradient; key blocks after the diagonal or before a window
are never computed; memory grows
linearly; it works under jit with a traced offset, in bf16, and with the batch sharded over 8 devices."""

import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxprs import count_eqns

import jaxmodel.attention as attention_module
from jaxmodel.attention import attention, blockwise_attention


def assert_close(got, want, rel: float = 1e-5, scale: float | None = None):
    """Equal within `rel` of `scale`, by default the largest entry of `want` (entries near zero carry the
    rounding of the large ones)."""
    want = np.asarray(want, np.float64)
    if scale is None:
        scale = np.abs(want).max() if want.size else 0.0
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=rel, atol=rel * scale)


def packed_segments(draw, s: int) -> np.ndarray:
    """Segment ids `[s]`: up to five documents, each drawn as padding (0) one time in four."""
    cuts = sorted(draw(st.lists(st.integers(1, s - 1), max_size=4, unique=True))) if s > 1 else []
    ids = np.zeros(s, np.int32)
    bounds = [0, *cuts, s]
    for doc, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        ids[lo:hi] = 0 if draw(st.integers(0, 3)) == 0 else doc + 1
    return ids


@st.composite
def attention_cases(draw) -> dict:
    """Queries are positions `[q_offset, q_offset + t)` of a key sequence `s` (as a context-parallel shard
    sees them), with keys possibly extending past the last query."""
    b = draw(st.integers(1, 2))
    kv_heads, ratio = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2, 4, 8]))
    h = draw(st.sampled_from([4, 16, 64]))
    t = draw(st.integers(1, 48))
    q_offset = draw(st.one_of(st.just(0), st.integers(1, 24)))
    s = q_offset + t + draw(st.one_of(st.just(0), st.integers(1, 16)))
    kv_seg_bs = np.stack([packed_segments(draw, s) for _ in range(b)])
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    return dict(
        q=rng.normal(size=(b, t, kv_heads * ratio, h)).astype(np.float32),
        k=rng.normal(size=(b, s, kv_heads, h)).astype(np.float32),
        v=rng.normal(size=(b, s, kv_heads, h)).astype(np.float32),
        cotangent=rng.normal(size=(b, t, kv_heads * ratio, h)).astype(np.float32),
        q_seg=kv_seg_bs[:, q_offset:q_offset + t], kv_seg=kv_seg_bs, q_offset=q_offset,
        window=draw(st.one_of(st.none(), st.integers(1, s))),
        block_q=draw(st.one_of(st.integers(1, 20), st.just(512))),
        block_kv=draw(st.one_of(st.integers(1, 20), st.just(512))))


def compiled_vjp(case: dict, impl: str, **kw):
    """A jitted `cotangent -> (output, (dq, dk, dv))` for the case's inputs."""
    def f(q, k, v):
        return attention(q, k, v, q_segment_ids=case["q_seg"], kv_segment_ids=case["kv_seg"],
                         q_offset=case["q_offset"], window=case["window"], impl=impl, **kw)

    @jax.jit
    def out_and_grads(cotangent):
        out, vjp = jax.vjp(f, case["q"], case["k"], case["v"])
        return out, vjp(cotangent)

    return lambda cotangent: jax.tree.map(np.asarray, out_and_grads(jnp.asarray(cotangent)))


def numpy_attention(q_btnh, k_bskh, v_bskh, q_seg_bt, kv_seg_bs, q_offset, window=None) -> np.ndarray:
    """float64, one head at a time, query head j on kv head j // r (transformers' repeat_kv); a key at most
    `window - 1` positions before its query (transformers' sliding_window_overlay: kv_idx > q_idx - window)."""
    b, t, n, h = q_btnh.shape
    s, k = k_bskh.shape[1:3]
    out = np.zeros((b, t, n, h))
    q_idx, kv_idx = q_offset + np.arange(t)[None, :, None], np.arange(s)[None, None, :]
    in_window = True if window is None else kv_idx > q_idx - window
    visible_bts = ((kv_idx <= q_idx) & in_window
                   & (q_seg_bt[:, :, None] == kv_seg_bs[:, None, :]) & (kv_seg_bs != 0)[:, None, :])
    for head in range(n):
        kv_head = head // (n // k)
        scores_bts = np.einsum("bth,bsh->bts", q_btnh[:, :, head].astype(np.float64),
                               k_bskh[:, :, kv_head].astype(np.float64)) * h ** -0.5
        scores_bts = np.where(visible_bts, scores_bts, -np.inf)
        peak = np.max(scores_bts, axis=-1, keepdims=True)
        p_bts = np.exp(scores_bts - np.where(np.isfinite(peak), peak, 0))
        p_bts /= np.maximum(p_bts.sum(-1, keepdims=True), 1e-300)
        out[:, :, head] = np.einsum("bts,bsh->bth", p_bts, v_bskh[:, :, kv_head])
    return out


@pytest.mark.slow
@settings(max_examples=12)
@given(case=attention_cases())
def test_plain_path_equals_numpy(case):
    """The reference itself, against an independent float64 computation, on real query rows."""
    out = attention(case["q"], case["k"], case["v"], q_segment_ids=case["q_seg"], kv_segment_ids=case["kv_seg"],
                    q_offset=case["q_offset"], window=case["window"], impl="xla")
    expected = numpy_attention(case["q"], case["k"], case["v"], case["q_seg"], case["kv_seg"], case["q_offset"],
                               case["window"])
    real = case["q_seg"] != 0
    assert_close(np.asarray(out)[real], expected[real])


@pytest.mark.slow
@settings(max_examples=25)
@given(case=attention_cases())
def test_blockwise_equals_plain_path(case):
    """Output on real query rows and q/k/v gradients equal the plain path's within 1e-5 of the largest
    entry; padding rows are zero and pass no gradient."""
    real_bt = case["q_seg"] != 0  # a real query sees at least itself; a padding one sees nothing
    # The plain path gives padding rows a uniform average of every key: compare gradients from real rows.
    cotangent = case["cotangent"] * real_bt[:, :, None, None]
    want_out, want_grads = compiled_vjp(case, "xla")(cotangent)
    blockwise = compiled_vjp(case, "blockwise", block_q=case["block_q"], block_kv=case["block_kv"])
    got_out, got_grads = blockwise(cotangent)
    assert_close(got_out[real_bt], want_out[real_bt])
    # One scale for the three gradients: a key's gradient can cancel to exactly zero in one path (a query
    # seeing one key) and to rounding in the other.
    scale = max(np.abs(g).max() for g in want_grads)
    for got, want in zip(got_grads, want_grads):
        assert_close(got, want, scale=scale)
    # Padding rows: zeros, and a cotangent on them alone moves nothing.
    assert np.all(got_out[~real_bt] == 0)
    _, padding_grads = blockwise(case["cotangent"] * ~real_bt[:, :, None, None])
    for grad in padding_grads:
        assert np.all(grad == 0)


def test_blockwise_with_more_queries_than_keys_equals_the_plain_path():
    """The last queries see every key: the default (no) window reaches past the keys' end."""
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.normal(size=(1, 48, 2, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(1, 24, 1, 8)), jnp.float32) for _ in range(2))
    got = blockwise_attention(q, k, v, block_q=16, block_kv=8)
    np.testing.assert_allclose(np.asarray(got), np.asarray(attention(q, k, v)), rtol=0, atol=1e-6)


def visited_blocks(monkeypatch, case: dict, **kw) -> tuple[set, set]:
    """The (query block, key block) pairs whose scores the forward and the backward pass compute."""
    seen = {"forward": set(), "backward": set()}
    tracing = {"pass": "forward"}  # which pass is being traced when the loop bodies call _masked_scores
    original = attention_module._masked_scores

    def recording(q_bkqh, k_bksh, q_seg_bt, kv_seg_bs, i, j, q_offset, window, scale):
        visits = seen[tracing["pass"]]
        jax.debug.callback(lambda i, j: visits.add((int(i), int(j))), i, j)
        return original(q_bkqh, k_bksh, q_seg_bt, kv_seg_bs, i, j, q_offset, window, scale)

    monkeypatch.setattr(attention_module, "_masked_scores", recording)
    f = lambda q, k, v: blockwise_attention(q, k, v, q_segment_ids=case["q_seg"], kv_segment_ids=case["kv_seg"],
                                            q_offset=case["q_offset"], window=case.get("window"), **kw)
    out, vjp = jax.vjp(f, case["q"], case["k"], case["v"])
    jax.block_until_ready(out)
    tracing["pass"] = "backward"
    jax.block_until_ready(vjp(jnp.ones_like(out)))
    jax.effects_barrier()
    return seen["forward"], seen["backward"]


@pytest.mark.parametrize("t, s, q_offset, bq, bk, window", [
    (40, 40, 0, 8, 8, None), (37, 50, 0, 8, 5, None), (20, 64, 30, 7, 9, None), (9, 40, 0, 4, 16, None),
    (40, 40, 0, 8, 8, 8), (40, 40, 0, 8, 8, 9), (37, 50, 0, 8, 5, 12), (20, 64, 30, 7, 9, 1), (64, 64, 0, 8, 8, 20)])
@pytest.mark.slow
def test_key_blocks_outside_the_visible_range_are_not_computed(monkeypatch, t, s, q_offset, bq, bk, window):
    """Exactly the block pairs with a key visible (by index: causal, and within the window) to a query are
    computed, in both passes."""
    rng = np.random.default_rng(0)
    case = dict(q=rng.normal(size=(1, t, 2, 4)), k=rng.normal(size=(1, s, 1, 4)), v=rng.normal(size=(1, s, 1, 4)),
                q_seg=np.ones((1, t), np.int32), kv_seg=np.ones((1, s), np.int32), q_offset=q_offset, window=window)
    forward, backward = visited_blocks(monkeypatch, case, block_q=bq, block_kv=bk)
    bq, bk = min(bq, t), min(bk, s)
    reach = s if window is None else window

    def visible(i, j):  # some key of block j within the causal window of some query of block i
        queries = range(q_offset + i * bq, q_offset + min((i + 1) * bq, t))
        return any(0 <= q - key < reach for q in queries for key in range(j * bk, min((j + 1) * bk, s)))

    needed = {(i, j) for i in range(-(-t // bq)) for j in range(-(-s // bk)) if visible(i, j)}
    assert forward == needed and backward == needed
    assert len(needed) < -(-t // bq) * -(-s // bk)  # some blocks are skipped in every case here


@pytest.mark.slow
def test_traced_query_offset_under_jit():
    """A context-parallel shard passes its offset as a traced value; the result is the static one's."""
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(2, 24, 4, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(2, 64, 2, 8)), jnp.float32) for _ in range(2))
    seg = jnp.ones((2, 64), jnp.int32).at[1, 50:].set(2)

    def f(q, k, v, offset):
        q_seg = jax.lax.dynamic_slice_in_dim(seg, offset, 24, axis=1)
        return attention(q, k, v, q_segment_ids=q_seg, kv_segment_ids=seg, q_offset=offset, impl="blockwise",
                         block_q=8, block_kv=8)

    traced = jax.jit(f)
    for offset in (0, 17, 40):
        static = attention(q, k, v, q_segment_ids=seg[:, offset:offset + 24], kv_segment_ids=seg, q_offset=offset,
                           impl="xla")
        assert_close(traced(q, k, v, jnp.int32(offset)), static)
        grads = jax.grad(lambda q, k, v: (traced(q, k, v, jnp.int32(offset)) ** 2).sum(), argnums=(0, 1, 2))(q, k, v)
        assert all(np.isfinite(np.asarray(g)).all() for g in grads)


@pytest.mark.slow
def test_bf16_error_is_within_one_bf16_epsilon_like_the_plain_paths():
    """bf16 inputs: against float32 attention on the same bf16 values, both paths' outputs and gradients
    are within one bf16 epsilon (2**-7) of the largest entry, i.e. within the final rounding (measured
    over three seeds: plain 0.2-0.4%, blockwise 0.2-0.45% of the largest entry)."""
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.normal(size=(2, 70, 8, 16)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.normal(size=(2, 70, 2, 16)), jnp.bfloat16) for _ in range(2))
    ct = jnp.asarray(rng.normal(size=(2, 70, 8, 16)), jnp.bfloat16)

    def out_and_grads(impl, dtype):
        f = lambda q, k, v: attention(q, k, v, impl=impl, block_q=16, block_kv=24)
        out, vjp = jax.vjp(jax.jit(f), *(x.astype(dtype) for x in (q, k, v)))
        return [out, *vjp(ct.astype(dtype))]

    exact = out_and_grads("xla", jnp.float32)
    for impl in ("xla", "blockwise"):
        for got, want in zip(out_and_grads(impl, jnp.bfloat16), exact):
            assert got.dtype == jnp.bfloat16
            want = np.asarray(want, np.float64)
            assert np.abs(np.asarray(got, np.float64) - want).max() <= 2 ** -7 * np.abs(want).max()


def test_batch_sharded_over_eight_devices_gives_the_same_result():
    mesh = jax.make_mesh((8,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,))
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.normal(size=(8, 30, 4, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(8, 30, 2, 8)), jnp.float32) for _ in range(2))
    seg = jnp.asarray(np.repeat(np.arange(8)[:, None] % 3 + 1, 30, axis=1) * (np.arange(30) < 25), jnp.int32)

    def loss(q, k, v, seg):
        out = attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, impl="blockwise", block_q=8, block_kv=8)
        return (out ** 2 * (seg != 0)[:, :, None, None]).sum(), out

    step = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
    want = jax.jit(step)(q, k, v, seg)
    shard = NamedSharding(mesh, P("batch"))
    sharded = jax.jit(step, in_shardings=(shard,) * 4)
    got = sharded(*(jax.device_put(x, shard) for x in (q, k, v, seg)))
    assert got[0][1].sharding.spec[0] == "batch"
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_close(g, w)


def gradient_temp_bytes(impl: str, t: int) -> int:
    q = jax.ShapeDtypeStruct((1, t, 4, 32), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, t, 2, 32), jnp.float32)

    def loss(q, k, v):
        return attention(q, k, v, impl=impl, block_q=128, block_kv=128).sum()

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.slow
def test_blockwise_gradient_memory_grows_linearly():
    """4x the sequence: the plain path's temporaries grow ~16x (the scores), the blockwise path's well
    under 8x (measured: 512 -> 2048 positions, plain 8.8 -> 138 MiB, blockwise 1.8 -> 4.1 MiB)."""
    plain = gradient_temp_bytes("xla", 2048) / gradient_temp_bytes("xla", 512)
    blockwise = gradient_temp_bytes("blockwise", 2048) / gradient_temp_bytes("blockwise", 512)
    assert plain > 12
    assert blockwise < 6


def test_unknown_implementation_and_dense_mask_for_blockwise_are_rejected():
    q = jnp.zeros((1, 4, 2, 8))
    k = jnp.zeros((1, 4, 1, 8))
    expected = f"attention must be one of {list(attention_module.ATTENTION_IMPLS)}, got 'flash'"
    with pytest.raises(ValueError, match=re.escape(expected)):
        attention(q, k, k, impl="flash")
    with pytest.raises(ValueError, match="segment ids, not a dense mask"):
        attention(q, k, k, impl="blockwise", mask_bts=jnp.ones((1, 4, 4), bool))


def test_bf16_causal_blocks_sum_their_key_and_value_gradients_in_float32():
    """Each causal query block attends to a prefix of the keys; the gradients of those prefixes are summed in float32
    and rounded once, not added in bf16 (XLA:CPU converts around every bf16 add, and each add rounds)."""
    b, t, n, k, h = 1, 4 * attention_module.CAUSAL_BLOCK_MIN, 4, 2, 16
    q, kk, v = (jnp.ones((b, t, heads, h), jnp.bfloat16) for heads in (n, k, k))

    def loss(q, kk, v):
        return attention(q, kk, v).astype(jnp.float32).sum()

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(1, 2)))(q, kk, v).jaxpr
    bf16_add = lambda eqn: eqn.primitive.name in ("add", "add_any") and eqn.outvars[0].aval.dtype == jnp.bfloat16
    assert count_eqns(jaxpr, bf16_add) == 0


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_remat_dots_keeps_the_softmax_probabilities_and_computes_no_exponential_again(dtype, capsys):
    """Under the `dots` policy the plain path keeps each causal block's probabilities, in the compute dtype,
    instead of its scores: the backward pass recomputes no softmax (bench/train.py's float32 step on a 2-core
    Xeon: 0.97 of the time), and the gradients are those of the step without rematerialisation."""
    from jaxmodel.matmul import DOT_POLICIES

    b, t, n, k, h = 1, 4 * attention_module.CAUSAL_BLOCK_MIN, 4, 2, 16
    rng = np.random.default_rng(5)
    q, kk, v = (jnp.asarray(rng.normal(size=(b, t, heads, h)), dtype) for heads in (n, k, k))

    def loss(q, kk, v):
        return (attention(q, kk, v).astype(jnp.float32) ** 2).sum()

    kept = jax.checkpoint(loss, policy=DOT_POLICIES["dots"])
    forward = jax.make_jaxpr(loss)(q, kk, v).jaxpr
    backward = jax.make_jaxpr(jax.grad(kept, argnums=(0, 1, 2)))(q, kk, v).jaxpr
    exp = lambda eqn: eqn.primitive.name == "exp"
    assert count_eqns(forward, exp) == attention_module.CAUSAL_BLOCKS
    assert count_eqns(backward, exp) == count_eqns(forward, exp)
    jax.ad_checkpoint.print_saved_residuals(kept, q, kk, v)
    # Kept `[b, k, rows, ·]` arrays: each causal block's output `[..., h]` and probabilities `[..., keys]`, 16-bit
    # ones as their bits; a block's scores, if kept too, would be one more.
    blocks = attention_module.CAUSAL_BLOCKS
    rows, saved = t // blocks * (n // k), "u16" if dtype == jnp.bfloat16 else "f32"
    kept_arrays = re.findall(rf"(\w+)\[{b},{k},{rows},(\d+)\] named 'batched_dot'", capsys.readouterr().out)
    want = Counter({(saved, str(h)): blocks, **{(saved, str(t // blocks * (j + 1))): 1 for j in range(blocks)}})
    assert Counter(kept_arrays) == want
    for got, want in zip(jax.jit(jax.grad(kept, argnums=(0, 1, 2)))(q, kk, v),
                         jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, kk, v)):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_remat_dots_keeps_the_blockwise_output_and_runs_its_forward_loop_once(dtype):
    """Under `dots` the blockwise path's output and log-sum-exp are kept like the plain path's batched dots: the
    gradient runs as many loops and exponentials as without rematerialisation (`dots_no_batch`, which keeps no
    batched dot, runs the forward loop again), and equals it."""
    from jaxmodel.matmul import DOT_POLICIES

    b, t, n, k, h = 1, 4 * attention_module.BLOCK_Q, 4, 2, 16
    rng = np.random.default_rng(6)
    q, kk, v = (jnp.asarray(rng.normal(size=(b, t, heads, h)), dtype) for heads in (n, k, k))

    def loss(q, kk, v):
        return (attention(q, kk, v, impl="blockwise").astype(jnp.float32) ** 2).sum()

    def loops_and_exps(f):
        jaxpr = jax.make_jaxpr(jax.grad(f, argnums=(0, 1, 2)))(q, kk, v).jaxpr
        return tuple(count_eqns(jaxpr, lambda eqn: eqn.primitive.name == name) for name in ("scan", "exp"))

    kept = jax.checkpoint(loss, policy=DOT_POLICIES["dots"])
    assert loops_and_exps(kept) == loops_and_exps(loss)
    assert loops_and_exps(jax.checkpoint(loss, policy=DOT_POLICIES["dots_no_batch"]))[0] > loops_and_exps(loss)[0]
    for got, want in zip(jax.jit(jax.grad(kept, argnums=(0, 1, 2)))(q, kk, v),
                         jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, kk, v)):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@settings(max_examples=10, deadline=None)
@given(b=st.integers(1, 2), k=st.sampled_from([1, 2]), r=st.sampled_from([1, 3]), t=st.integers(1, 4),
       s_extra=st.integers(0, 5), offset=st.integers(0, 6), window=st.sampled_from([None, 2, 5]),
       seed=st.integers(0, 2**16))
def test_attention_over_a_cache_and_the_new_tokens_is_the_plain_path_over_them_written_in(b, k, r, t, s_extra, offset,
                                                                                          window, seed):
    """cached_attention (the cache's slots before the offset, read as they are, and the new tokens apart) equals
    the plain path over the cache with the new tokens written at the offset, with left padding and windows; slots
    past the new tokens hold garbage either way."""
    from jaxmodel.attention import attention, cached_attention

    rng = np.random.default_rng(seed)
    h, s = 4, offset + t + s_extra
    q = jnp.asarray(rng.standard_normal((b, t, k * r, h)), jnp.float32)
    new_k, new_v = (jnp.asarray(rng.standard_normal((b, t, k, h)), jnp.float32) for _ in range(2))
    cache_k, cache_v = (jnp.asarray(rng.standard_normal((b, k, s, h)), jnp.float32) for _ in range(2))
    valid = rng.random((b, s)) < 0.8
    valid[:, offset:offset + t] = True  # the new tokens are real
    mask_bts = jnp.broadcast_to(jnp.asarray(valid)[:, None, :], (b, t, s))
    written_k, written_v = (jax.lax.dynamic_update_slice(c, x.transpose(0, 2, 1, 3), (0, 0, offset, 0)).transpose(
        0, 2, 1, 3) for c, x in ((cache_k, new_k), (cache_v, new_v)))
    expected = attention(q, written_k, written_v, mask_bts=mask_bts, q_offset=offset, window=window)
    got = cached_attention(q, new_k, new_v, cache_k, cache_v, mask_bts=mask_bts, q_offset=jnp.int32(offset),
                           window=window)
    # rows that see no key at all are garbage on both paths
    seen = np.asarray(jnp.any(mask_bts & jnp.asarray(
        (np.arange(s)[None, :] <= offset + np.arange(t)[:, None]) & (
            True if window is None else offset + np.arange(t)[:, None] - np.arange(s)[None, :] < window)), axis=-1))
    np.testing.assert_allclose(np.asarray(got)[seen], np.asarray(expected)[seen], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("window", [None, 2])
def test_a_prefill_over_an_empty_cache_attends_over_its_own_tokens_alone(window):
    """cached_attention at the static offset 0 (a prefill) skips the cache and equals its traced-offset path, with
    left padding."""
    from jaxmodel.attention import cached_attention

    rng = np.random.default_rng(5)
    b, t, k, r, h, s = 2, 5, 2, 2, 4, 9
    q = jnp.asarray(rng.standard_normal((b, t, k * r, h)), jnp.float32)
    new_k, new_v = (jnp.asarray(rng.standard_normal((b, t, k, h)), jnp.float32) for _ in range(2))
    cache_k, cache_v = (jnp.asarray(rng.standard_normal((b, k, s, h)), jnp.float32) for _ in range(2))
    valid = np.ones((b, s), bool)
    valid[1, :2] = False  # row 1's prompt left-padded by two
    mask_bts = jnp.broadcast_to(jnp.asarray(valid)[:, None, :], (b, t, s))
    static = cached_attention(q, new_k, new_v, cache_k, cache_v, mask_bts=mask_bts, q_offset=0, window=window)
    traced = jax.jit(lambda offset: cached_attention(q, new_k, new_v, cache_k, cache_v, mask_bts=mask_bts,
                                                     q_offset=offset, window=window))(jnp.int32(0))
    np.testing.assert_allclose(np.asarray(static)[0], np.asarray(traced)[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(static)[1, 2:], np.asarray(traced)[1, 2:], rtol=1e-5, atol=1e-6)
