"""Masked next-token cross-entropy (jaxmodel/loss.py).

Behaviour checked:
- `cross_entropy_sums` is the float64 log-softmax loss and what finetune's `loss_sums` computes from logits;
- the chunked head + loss equals the full-logits reference in value and in its gradients with respect to
  the hidden states, the head weight and a LoRA pair inside the head, for any batch, sequence (divisible by
  the chunk or not), chunk, vocabulary and mask (all-zero rows too), within 1e-5 relative in float32; with
  bfloat16 hidden states and weight, within what bfloat16 rounding allows;
- it takes an NNX head merged from a split LoRA state, under `jax.jit` and `jax.grad`;
- its compiled gradient needs less temporary memory than one float32 logits array where the reference
  needs three, growing with the sequence by about one hidden-state row per position;
- sharding the batch (and the vocabulary) over 8 devices changes nothing but the layout;
- the frozen-head loss equals the full-logits reference in value and in d/dh, for any cotangent (per token, as
  the preference objectives weigh each position's log-probability), within 1e-5 relative in float32 and one bfloat16 step in bfloat16, gives the head weight no gradient, computes the head's
  matmul twice (the logits, d/dh) where the chunked loss does three times, needs less temporary memory than one
  logits array, caps a chunk at `device_rows` rows of each device's part of the batch, and is what finetune's
  `loss_sums` takes for a head without LoRA, sharded or not.
"""

from __future__ import annotations

import functools
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import example, given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxprs import count_eqns

from jaxmodel import ModelConfig, CausalLM
from jaxmodel.layers import LoRAParam
from jaxmodel.lora import LoraConfig, apply_lora
from jaxmodel.loss import (CPU_EXP_SUM_ROW, FROZEN_HEAD_DEVICE_ROWS, chunked_token_losses, cross_entropy_sums,
                           frozen_head_token_losses, log_sum_exp, token_losses)

F32_RTOL = 1e-5


def chunked_cross_entropy_sums(head_fn, h, targets, mask, *, chunk, **kw):
    """(masked sum, target tokens) of `chunked_token_losses`, as finetune's loss sums them."""
    return jnp.sum(chunked_token_losses(head_fn, h, targets, chunk=chunk, **kw) * mask), jnp.sum(mask)


def frozen_head_cross_entropy_sums(h, w, targets, mask, *, chunk, **kw):
    """(masked sum, target tokens) of `frozen_head_token_losses`."""
    return jnp.sum(frozen_head_token_losses(h, w, targets, chunk=chunk, **kw) * mask), jnp.sum(mask)
BF16_UNIT_ROUNDOFF = 2.0 ** -8  # 8 significand bits, round to nearest


class Problem(NamedTuple):
    batch: int
    seq: int
    chunk: int
    vocab: int
    hidden: int
    rank: int
    zero_rows: tuple[bool, ...]  # rows whose mask is all zero
    seed: int


@st.composite
def problems(draw) -> Problem:
    batch = draw(st.integers(1, 3))
    return Problem(batch=batch, seq=draw(st.integers(1, 40)), chunk=draw(st.integers(1, 16)),
                   vocab=draw(st.integers(2, 70)), hidden=draw(st.integers(1, 12)), rank=draw(st.integers(1, 4)),
                   zero_rows=tuple(draw(st.lists(st.booleans(), min_size=batch, max_size=batch))),
                   seed=draw(st.integers(0, 2 ** 16)))


def arrays(p: Problem, dtype=jnp.float32) -> dict[str, jax.Array]:
    """Hidden states, head weight and LoRA pair scaled so that logits spread over several units, random
    targets, a ~70% mask with the chosen rows zeroed."""
    rng = np.random.default_rng(p.seed)
    mask_bt = (rng.random((p.batch, p.seq)) < 0.7) & ~np.asarray(p.zero_rows)[:, None]
    return {
        "h": jnp.asarray(rng.normal(size=(p.batch, p.seq, p.hidden)), dtype),
        "w": jnp.asarray(rng.normal(size=(p.vocab, p.hidden)) * 2 / np.sqrt(p.hidden), dtype),
        "a": jnp.asarray(rng.normal(size=(p.hidden, p.rank)) / np.sqrt(p.hidden), jnp.float32),
        "b": jnp.asarray(rng.normal(size=(p.rank, p.vocab)), jnp.float32),
        "targets": jnp.asarray(rng.integers(0, p.vocab, (p.batch, p.seq)), jnp.int32),
        "mask": jnp.asarray(mask_bt, jnp.float32),
    }


def lora_head(w_vd, a_dr, b_rv):
    """The model's head (float32 logits from `h @ w.T`) plus a float32 LoRA branch, as a closure."""
    def head_fn(h_bcd):
        base_bcv = jnp.einsum("bcd,vd->bcv", h_bcd, w_vd, preferred_element_type=jnp.float32)
        return base_bcv + (h_bcd.astype(jnp.float32) @ a_dr) @ b_rv
    return head_fn


def full_loss(h, w, a, b, targets, mask):
    return cross_entropy_sums(lora_head(w, a, b)(h), targets, mask)


def chunked_loss(h, w, a, b, targets, mask, *, chunk):
    return chunked_cross_entropy_sums(lora_head(w, a, b), h, targets, mask, chunk=chunk)


def sums_and_grads(fn):
    """(loss sum, count, d loss sum / d (h, w, a, b)) of `fn(h, w, a, b, targets, mask)`."""
    def run(h, w, a, b, targets, mask):
        (loss, count), grads = jax.value_and_grad(lambda *hwab: fn(*hwab, targets, mask), argnums=(0, 1, 2, 3),
                                                  has_aux=True)(h, w, a, b)
        return loss, count, grads
    return run


@functools.cache
def loss_and_grads(chunk: int | None):
    """jit of `sums_and_grads` for the full-logits (None) or the chunked loss."""
    return jax.jit(sums_and_grads(full_loss if chunk is None else functools.partial(chunked_loss, chunk=chunk)))


def assert_close(actual, expected, rtol: float = F32_RTOL):
    """max |actual - expected| <= rtol * max |expected|: relative to the array's scale, since single
    entries of a gradient may cancel to near zero."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape
    err, scale = np.max(np.abs(actual - expected), initial=0.0), np.max(np.abs(expected), initial=0.0)
    assert err <= rtol * scale, f"max error {err:.3g} > {rtol:g} x scale {scale:.3g}"


def numpy_losses(logits_btv: np.ndarray, targets_bt: np.ndarray) -> np.ndarray:
    """-log softmax(logits)[target] in float64."""
    logits = logits_btv.astype(np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    log_softmax = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    return -np.take_along_axis(log_softmax, targets_bt[..., None], -1)[..., 0]


@pytest.mark.slow
def test_reference_is_the_float64_loss_and_finetune_loss_sums():
    from finetune.step.train_step import loss_sums

    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(3, 11, 40)) * 4, jnp.float32)
    targets = jnp.asarray(rng.integers(0, 40, (3, 11)), jnp.int32)
    mask = jnp.asarray(rng.random((3, 11)) < 0.6, jnp.float32)
    loss, count = cross_entropy_sums(logits, targets, mask)
    expected = (numpy_losses(np.asarray(logits), np.asarray(targets)) * np.asarray(mask)).sum()
    assert_close(loss, expected)
    assert float(count) == np.asarray(mask).sum()

    config = ModelConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    model = CausalLM(config, rngs=nnx.Rngs(0))
    ids = jnp.asarray(rng.integers(0, 40, (3, 11)), jnp.int32)
    batch = {"input_ids": ids, "targets": targets, "loss_mask": mask, "segment_ids": jnp.ones_like(ids),
             "positions": jnp.broadcast_to(jnp.arange(11), (3, 11))}
    logits = model(ids, positions=batch["positions"], segment_ids=batch["segment_ids"])
    for got, want in zip(cross_entropy_sums(logits, targets, mask), loss_sums(model, batch)):
        np.testing.assert_array_equal(got, want)


@pytest.mark.slow
@settings(max_examples=12)
@example(Problem(batch=2, seq=13, chunk=4, vocab=9, hidden=5, rank=2, zero_rows=(True, False), seed=1))
@example(Problem(batch=1, seq=16, chunk=4, vocab=7, hidden=3, rank=1, zero_rows=(False,), seed=2))
@example(Problem(batch=2, seq=5, chunk=8, vocab=3, hidden=4, rank=3, zero_rows=(True, True), seed=3))
@given(problems())
def test_chunked_equals_full_logits_in_float32(p: Problem):
    x = arrays(p)
    loss, count, grads = loss_and_grads(p.chunk)(**x)
    want_loss, want_count, want_grads = loss_and_grads(None)(**x)
    assert_close(loss, want_loss)
    assert float(count) == float(want_count)
    for name, got, want in zip("hwab", grads, want_grads):
        assert got.dtype == want.dtype, name
        assert_close(got, want)


@pytest.mark.slow
def test_padding_of_the_last_chunk_does_not_count():
    """seq 13 in chunks of 4 leaves 3 padded positions in the last chunk; with every real position
    counted, the value and count are the reference's."""
    p = Problem(batch=2, seq=13, chunk=4, vocab=11, hidden=6, rank=2, zero_rows=(False, False), seed=4)
    x = arrays(p) | {"mask": jnp.ones((2, 13), jnp.float32)}
    loss, count = chunked_loss(**x, chunk=4)
    assert_close(loss, full_loss(**x)[0])
    assert float(count) == 26.0


def test_logits_far_from_zero_stay_finite_and_exact():
    """Logits near 200 overflow exp in float32: the log-sum-exp must shift by the maximum."""
    x = arrays(Problem(batch=2, seq=9, chunk=4, vocab=30, hidden=6, rank=2, zero_rows=(False, False), seed=8))

    def shifted(loss_fn):
        def run(h, w, a, b, targets, mask):
            head_fn = lambda h_bcd: lora_head(w, a, b)(h_bcd) + 200.0
            return loss_fn(head_fn, h, targets, mask)[0]
        return jax.jit(jax.value_and_grad(run, argnums=(0, 1, 2, 3)))

    full = shifted(lambda head_fn, h, targets, mask: cross_entropy_sums(head_fn(h), targets, mask))
    chunked = shifted(functools.partial(chunked_cross_entropy_sums, chunk=4))
    args = [x[k] for k in ("h", "w", "a", "b", "targets", "mask")]
    (loss, grads), (want_loss, want_grads) = chunked(*args), full(*args)
    assert np.isfinite(float(loss))
    assert_close(loss, want_loss)
    for got, want in zip(grads, want_grads):
        assert_close(got, want)


@pytest.mark.slow
@settings(max_examples=5)
@example(Problem(batch=2, seq=29, chunk=4, vocab=40, hidden=12, rank=2, zero_rows=(False, True), seed=5))
@example(Problem(batch=1, seq=7, chunk=1, vocab=15, hidden=8, rank=4, zero_rows=(False,), seed=0))
@given(problems())
def test_chunked_equals_full_logits_in_bfloat16(p: Problem):
    """bfloat16 h and weight, float32 LoRA. The logits are float32 sums of exact bfloat16 products in both
    paths, so the loss and the LoRA gradients agree to float32 accuracy. d/dh is the same per-position
    float32 sum rounded once to bfloat16: at most one bfloat16 step apart (2^-7 relative). d/dw is rounded
    to bfloat16 once per chunk and summed over chunks in bfloat16 (the scan's accumulator has the weight's
    dtype), so it is judged against the float64 value with that error bound."""
    x = arrays(p, jnp.bfloat16)
    loss, count, (dh, dw, da, db) = loss_and_grads(p.chunk)(**x)
    want_loss, want_count, (want_dh, _, want_da, want_db) = loss_and_grads(None)(**x)
    assert_close(loss, want_loss)
    assert float(count) == float(want_count)
    assert_close(da, want_da)
    assert_close(db, want_db)
    assert dh.dtype == dw.dtype == jnp.bfloat16
    f32_noise = F32_RTOL * np.max(np.abs(np.asarray(want_dh, np.float64)), initial=0.0)
    np.testing.assert_allclose(np.asarray(dh, np.float64), np.asarray(want_dh, np.float64), rtol=2.0 ** -7,
                               atol=f32_noise)

    exact_dw, bound = bf16_weight_gradient_bound(p, x)
    err = np.abs(np.asarray(dw, np.float64) - exact_dw)
    assert np.all(err <= bound + F32_RTOL * np.max(np.abs(exact_dw), initial=0.0))


def bf16_weight_gradient_bound(p: Problem, x) -> tuple[np.ndarray, np.ndarray]:
    """(float64 d loss / d w, elementwise bound on the chunked bfloat16 result's error): chunk k's partial
    G_k is rounded, then added to the running sum S_k and rounded: |error| <= u * sum_k(|G_k| + |S_k|).
    The backward pass of the scan visits the chunks last to first, so S_k sums chunks n-1 down to k."""
    h = np.asarray(x["h"], np.float64)
    w, a, b = (np.asarray(x[k], np.float64) for k in "wab")
    logits = h @ w.T + (h @ a) @ b
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    one_hot = np.eye(p.vocab)[np.asarray(x["targets"])]
    dlogits_btv = (probs - one_hot) * np.asarray(x["mask"], np.float64)[..., None]
    chunk = min(p.chunk, p.seq)
    partials = [np.einsum("btv,btd->vd", dlogits_btv[:, s:s + chunk], h[:, s:s + chunk])
                for s in range(0, p.seq, chunk)]
    running = np.cumsum(partials[::-1], axis=0)
    bound = BF16_UNIT_ROUNDOFF * (np.abs(partials).sum(0) + np.abs(running).sum(0))
    return running[-1], bound


@pytest.mark.slow
def test_nnx_lora_head_under_jit_and_grad_of_the_split_lora_state():
    """The LoRA-carrying lm_head of a model merged from `nnx.split(model, LoRAParam, ...)` as head_fn:
    the gradient with respect to the LoRA state equals the full-logits one."""
    config = ModelConfig(vocab_size=72, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    model = apply_lora(CausalLM(config, rngs=nnx.Rngs(0)), LoraConfig(targets=("lm_head",)),
                       rngs=nnx.Rngs(1))
    head = model.lm_head
    head.lora_b.set_value(jax.random.normal(jax.random.key(2), head.lora_b[...].shape))
    graphdef, lora, base = nnx.split(model, LoRAParam, ...)
    x = arrays(Problem(batch=2, seq=21, chunk=8, vocab=72, hidden=16, rank=8, zero_rows=(False, False), seed=6))

    def loss(lora, h, chunk):
        merged = nnx.merge(graphdef, base, lora)
        if chunk is None:
            return cross_entropy_sums(merged.lm_head(h), x["targets"], x["mask"])[0]
        return chunked_cross_entropy_sums(merged.lm_head, h, x["targets"], x["mask"], chunk=chunk)[0]

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=2)
    (got_loss, (got_lora, got_dh)), (want_loss, (want_lora, want_dh)) = grad(lora, x["h"], 8), grad(lora, x["h"], None)
    assert_close(got_loss, want_loss)
    assert_close(got_dh, want_dh)
    flat_got, flat_want = nnx.to_flat_state(got_lora), nnx.to_flat_state(want_lora)
    assert [path for path, _ in flat_got] == [("lm_head", "lora_a"), ("lm_head", "lora_b")]
    for (_, got), (_, want) in zip(flat_got, flat_want):
        assert float(jnp.max(jnp.abs(want[...]))) > 0
        assert_close(got[...], want[...])


def grad_temp_bytes(chunk: int | None, seq: int, hidden: int = 64, vocab: int = 4096) -> int:
    """Temporary bytes of the compiled d loss / d (h, w, a, b) for batch 1, from shapes alone."""
    shapes = [((1, seq, hidden), jnp.float32), ((vocab, hidden), jnp.float32), ((hidden, 8), jnp.float32),
              ((8, vocab), jnp.float32), ((1, seq), jnp.int32), ((1, seq), jnp.float32)]
    args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]
    fn = full_loss if chunk is None else functools.partial(chunked_loss, chunk=chunk)
    grad = jax.grad(lambda *x: fn(*x)[0], argnums=(0, 1, 2, 3))
    return jax.jit(grad).lower(*args).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.slow
def test_chunked_gradient_memory_is_below_one_logits_array_and_linear_in_seq():
    hidden, vocab = 64, 4096
    logits_bytes = 2048 * vocab * 4
    assert grad_temp_bytes(None, 2048) >= 2 * logits_bytes  # the reference: logits, softmax, their gradient
    temps = {seq: grad_temp_bytes(256, seq) for seq in (1024, 2048, 4096)}
    assert temps[2048] < logits_bytes / 2
    per_position = [(temps[2048] - temps[1024]) / 1024, (temps[4096] - temps[2048]) / 2048]
    assert per_position[1] == pytest.approx(per_position[0], rel=0.1)  # linear in seq
    assert per_position[1] <= 2 * hidden * 4  # a hidden-state row or two per position, no vocab row


@pytest.mark.parametrize("mesh_shape, batch_spec, w_spec, b_spec", [
    ((8, 1, 1), P(("dp", "fsdp")), P(), P()),  # batch split 8 ways
    ((2, 2, 2), P(("dp", "fsdp")), P("mp", "fsdp"), P(None, "mp")),  # and the vocab over mp, as DEFAULT_RULES
])
@pytest.mark.slow
def test_sharded_batch_and_vocab_give_the_unsharded_result(mesh_shape, batch_spec, w_spec, b_spec):
    p = Problem(batch=8, seq=19, chunk=8, vocab=96, hidden=32, rank=4, zero_rows=(False,) * 7 + (True,), seed=7)
    x = arrays(p)
    run = loss_and_grads(p.chunk)
    want_loss, _, want_grads = run(**x)

    mesh = jax.make_mesh(mesh_shape, ("dp", "fsdp", "mp"), axis_types=(jax.sharding.AxisType.Auto,) * 3)
    specs = {"h": batch_spec, "w": w_spec, "a": P(), "b": b_spec, "targets": batch_spec, "mask": batch_spec}
    with jax.set_mesh(mesh):
        placed = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in x.items()}
        loss, _, grads = run(**placed)
        hlo = run.lower(**placed).compile().as_text()
    assert_close(loss, want_loss)
    for got, want in zip(grads, want_grads):
        assert_close(got, want)
    rows_per_device = p.batch // (mesh_shape[0] * mesh_shape[1])
    assert grads[0].sharding.shard_shape(grads[0].shape)[0] == rows_per_device  # d/dh stays split by rows
    # Nothing is gathered to the whole vocabulary: logits stay split (over the batch, and the vocab on mp).
    assert all(str(p.vocab) not in dims for dims in gathered_dims(hlo)), gathered_dims(hlo)


def gathered_dims(hlo_text: str) -> list[list[str]]:
    """Result dimensions of every all-gather / all-to-all in compiled HLO text."""
    found = re.findall(r"= \w+\[([\d,]*)\][^ ]* (?:all-gather|all-to-all)\(", hlo_text)
    return [dims.split(",") for dims in found]


def test_chunk_must_be_positive():
    x = arrays(Problem(batch=1, seq=4, chunk=1, vocab=3, hidden=2, rank=1, zero_rows=(False,), seed=0))
    with pytest.raises(ValueError, match="chunk must be a positive"):
        chunked_loss(**x, chunk=0)


# The frozen-head loss: the head `h @ w.T` with no LoRA on it, d/dh only.

def plain_head_loss(h, w, targets, mask):
    logits = jnp.einsum("btd,vd->btv", h, w, preferred_element_type=jnp.float32)
    return cross_entropy_sums(logits, targets, mask)


def frozen_head_loss(h, w, targets, mask, *, chunk, device_rows=FROZEN_HEAD_DEVICE_ROWS):
    return frozen_head_cross_entropy_sums(h, w, targets, mask, chunk=chunk, device_rows=device_rows)


@functools.cache
def frozen_head_grads(chunk: int | None, device_rows: int = 512, scale: float = 1.0):
    """jit of (loss sum, count, d (scale x loss sum) / d (h, w)) of the plain (None) or the frozen-head loss."""
    fn = plain_head_loss if chunk is None else functools.partial(frozen_head_loss, chunk=chunk,
                                                                 device_rows=device_rows)

    def run(h, w, targets, mask):
        (loss, count), grads = jax.value_and_grad(lambda h, w: fn(h, w, targets, mask), argnums=(0, 1),
                                                  has_aux=True)(h, w)
        (_, _), scaled = jax.value_and_grad(lambda h, w: (scale * fn(h, w, targets, mask)[0], 0), argnums=(0, 1),
                                            has_aux=True)(h, w)
        return loss, count, grads, scaled
    return jax.jit(run)


def frozen_arrays(p: Problem, dtype=jnp.float32) -> dict[str, jax.Array]:
    return {k: v for k, v in arrays(p, dtype).items() if k not in ("a", "b")}


@settings(max_examples=12)
@example(Problem(batch=2, seq=13, chunk=4, vocab=9, hidden=5, rank=1, zero_rows=(True, False), seed=1), 512)
@example(Problem(batch=3, seq=16, chunk=16, vocab=7, hidden=3, rank=1, zero_rows=(False, False, False), seed=2), 4)
@example(Problem(batch=2, seq=5, chunk=8, vocab=3, hidden=4, rank=1, zero_rows=(True, True), seed=3), 1)
@given(problems(), st.sampled_from([1, 4, 512]))
@pytest.mark.slow
def test_frozen_head_equals_full_logits_in_float32(p: Problem, device_rows: int):
    """Any sequence, chunk and row cap (device_rows 1 and 4 make chunks of fewer positions than asked); the
    gradient scaled by a cotangent of 2.5 is 2.5 times the gradient; the weight gets none."""
    x = frozen_arrays(p)
    loss, count, (dh, dw), (scaled_dh, scaled_dw) = frozen_head_grads(p.chunk, device_rows, 2.5)(**x)
    want_loss, want_count, (want_dh, _), _ = frozen_head_grads(None, scale=2.5)(**x)
    assert_close(loss, want_loss)
    assert float(count) == float(want_count)
    assert dh.dtype == jnp.float32
    assert_close(dh, want_dh)
    assert_close(scaled_dh, 2.5 * np.asarray(want_dh))
    assert not np.any(np.asarray(dw)) and not np.any(np.asarray(scaled_dw))


@settings(max_examples=5)
@example(Problem(batch=2, seq=29, chunk=4, vocab=40, hidden=12, rank=1, zero_rows=(False, True), seed=5))
@given(problems())
@pytest.mark.slow
def test_frozen_head_equals_full_logits_in_bfloat16(p: Problem):
    """bfloat16 h and weight: the logits are float32 sums of exact bfloat16 products in both paths, and d/dh
    is the same float32 sum over the vocabulary of a bfloat16-rounded factor, rounded once to bfloat16: at most
    one bfloat16 step apart (2^-7 relative), the factor's own rounding (2^-8 relative) aside."""
    x = frozen_arrays(p, jnp.bfloat16)
    loss, count, (dh, _), _ = frozen_head_grads(p.chunk)(**x)
    want_loss, want_count, (want_dh, _), _ = frozen_head_grads(None)(**x)
    assert_close(loss, want_loss)
    assert float(count) == float(want_count)
    assert dh.dtype == jnp.bfloat16
    scale = np.max(np.abs(np.asarray(want_dh, np.float64)), initial=0.0)
    np.testing.assert_allclose(np.asarray(dh, np.float64), np.asarray(want_dh, np.float64), rtol=2.0 ** -7,
                               atol=2 * BF16_UNIT_ROUNDOFF * scale)


@settings(max_examples=8)
@example(Problem(batch=2, seq=13, chunk=4, vocab=9, hidden=5, rank=1, zero_rows=(True, False), seed=1))
@given(problems())
@pytest.mark.slow
def test_frozen_head_token_losses_and_their_gradient_under_any_cotangent_are_the_plain_ones(p: Problem):
    """Each position's loss, and d (sum of c_t x loss_t) / dh for drawn weights c (of either sign: the
    preference objectives' cotangents), within 1e-5 relative in float32."""
    x = frozen_arrays(p)
    c_bt = jnp.asarray(np.random.default_rng(p.seed + 1).normal(size=(p.batch, p.seq)), jnp.float32)

    def plain(h):
        return token_losses(jnp.einsum("btd,vd->btv", h, x["w"], preferred_element_type=jnp.float32), x["targets"])

    def frozen(h):
        return frozen_head_token_losses(h, x["w"], x["targets"], chunk=p.chunk)

    def weighted_sum_and_grad(fn):
        return jax.jit(jax.value_and_grad(lambda h: jnp.sum(fn(h) * c_bt)))(x["h"])

    want_losses = jax.jit(plain)(x["h"])
    assert_close(jax.jit(frozen)(x["h"]), want_losses)
    (got, got_dh), (want, want_dh) = weighted_sum_and_grad(frozen), weighted_sum_and_grad(plain)
    # relative to the terms: with weights of either sign the sum itself may cancel to near zero
    assert abs(float(got) - float(want)) <= F32_RTOL * float(jnp.sum(jnp.abs(c_bt * want_losses)))
    assert_close(got_dh, want_dh)


@pytest.mark.parametrize("vocab", [1000, 32768, 32769, 49152, 50257, 128256, 50021, 98317])  # the last two: primes
def test_log_sum_exp_is_jaxs_and_the_cpu_sums_no_row_of_more_than_cpu_exp_sum_row(vocab):
    """Value and gradient equal `jax.nn.logsumexp`'s; on the CPU, no exponential is summed over a row longer than
    CPU_EXP_SUM_ROW, where XLA:CPU's fused exp-and-sum falls off its fast path."""
    rng = np.random.default_rng(vocab)
    x = jnp.asarray(rng.normal(size=(3, 2, vocab)) * 6, jnp.float32)
    c = jnp.asarray(rng.normal(size=(3, 2)), jnp.float32)

    def value_and_grad(fn):
        return jax.jit(jax.value_and_grad(lambda x: jnp.sum(fn(x) * c)))(x)

    assert_close(jax.jit(log_sum_exp)(x), jax.jit(lambda x: jax.nn.logsumexp(x, axis=-1))(x))
    assert float(jax.jit(log_sum_exp)(jnp.full((1, vocab), -jnp.inf))[0]) == -np.inf  # as jax.nn.logsumexp
    (_, got), (_, want) = value_and_grad(log_sum_exp), value_and_grad(lambda x: jax.nn.logsumexp(x, axis=-1))
    assert_close(got, want)
    hlo = jax.jit(log_sum_exp).lower(x).compile().as_text()
    rows = [int(dims.split(",")[-1]) for dims in re.findall(r"= f32\[([\d,]+)\][^ ]* exponential\(", hlo)]
    assert rows and max(rows) <= CPU_EXP_SUM_ROW, rows


def compiled_dots(loss_fn, *args) -> int:
    """How many dots the compiled loss and d loss / d h hold (a loop body's counted once)."""
    hlo = jax.jit(jax.value_and_grad(lambda *a: loss_fn(*a)[0])).lower(*args).compile().as_text()
    return len(re.findall(r" dot\(", hlo))


def test_frozen_head_computes_the_head_matmul_twice_where_the_chunked_loss_does_three_times():
    p = Problem(batch=2, seq=24, chunk=8, vocab=50, hidden=6, rank=1, zero_rows=(False, False), seed=9)
    x = frozen_arrays(p)
    args = (x["h"], x["w"], x["targets"], x["mask"])
    chunked = functools.partial(chunked_cross_entropy_sums, chunk=8)
    assert compiled_dots(lambda h, w, t, m: frozen_head_loss(h, w, t, m, chunk=8), *args) == 2
    assert compiled_dots(lambda h, w, t, m: chunked(lambda h_bcd: jnp.einsum("bcd,vd->bcv", h_bcd, w), h, t, m),
                         *args) == 3


def frozen_grad_temp_bytes(seq: int, chunk: int, hidden: int = 64, vocab: int = 4096) -> int:
    """Temporary bytes of the compiled d loss / d h of the frozen-head loss for batch 1, from shapes alone."""
    args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in
            [((1, seq, hidden), jnp.float32), ((vocab, hidden), jnp.float32), ((1, seq), jnp.int32),
             ((1, seq), jnp.float32)]]
    grad = jax.grad(lambda h, w, t, m: frozen_head_loss(h, w, t, m, chunk=chunk)[0])
    return jax.jit(grad).lower(*args).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.slow
def test_frozen_head_gradient_memory_is_below_one_logits_array_and_linear_in_seq():
    hidden, vocab = 64, 4096
    logits_bytes = 2048 * vocab * 4
    temps = {seq: frozen_grad_temp_bytes(seq, 256) for seq in (1024, 2048, 4096)}
    assert temps[2048] < logits_bytes / 2
    per_position = [(temps[2048] - temps[1024]) / 1024, (temps[4096] - temps[2048]) / 2048]
    assert per_position[1] == pytest.approx(per_position[0], rel=0.1)  # linear in seq
    assert per_position[1] <= 2 * hidden * 4  # a hidden-state row or two per position (d/dh), no vocab row


def scan_lengths(fn, *args) -> list[int]:
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    found = []
    count_eqns(jaxpr, lambda eqn: eqn.primitive.name == "scan" and found.append(eqn.params["length"]))
    return found


@pytest.mark.parametrize("mesh_shape, batch, device_rows, positions", [
    (None, 16, 32, 2),  # 16 rows on one device: 2 positions a chunk
    ((8, 1, 1), 16, 32, 16),  # 2 rows a device: 16 positions
    ((2, 2, 2), 16, 32, 8),  # 4 rows a device (dp x fsdp): 8 positions
    ((8, 1, 1), 4, 32, 8),  # 4 rows do not split 8 ways: each device holds all 4
    (None, 2, 512, 24),  # capped by `chunk`
])
def test_a_chunk_holds_at_most_device_rows_of_each_devices_part_of_the_batch(mesh_shape, batch, device_rows,
                                                                            positions):
    seq = 48
    x = frozen_arrays(Problem(batch=batch, seq=seq, chunk=24, vocab=16, hidden=4, rank=1,
                              zero_rows=(False,) * batch, seed=0))

    def loss(h):
        return frozen_head_loss(h, x["w"], x["targets"], x["mask"], chunk=24, device_rows=device_rows)[0]

    if mesh_shape is None:
        assert scan_lengths(loss, x["h"]) == [seq // positions]
        return
    mesh = jax.make_mesh(mesh_shape, ("dp", "fsdp", "mp"), axis_types=(jax.sharding.AxisType.Auto,) * 3)
    with jax.set_mesh(mesh):
        assert scan_lengths(loss, x["h"]) == [seq // positions]


@pytest.mark.parametrize("mesh_shape, batch_spec, w_spec", [
    ((8, 1, 1), P(("dp", "fsdp")), P()),  # batch split 8 ways
    ((2, 2, 2), P(("dp", "fsdp")), P("mp", "fsdp")),  # and the vocab over mp, as DEFAULT_RULES
])
@pytest.mark.slow
def test_frozen_head_sharded_gives_the_unsharded_result(mesh_shape, batch_spec, w_spec):
    p = Problem(batch=8, seq=19, chunk=8, vocab=96, hidden=32, rank=1, zero_rows=(False,) * 7 + (True,), seed=7)
    x = frozen_arrays(p)
    run = frozen_head_grads(p.chunk)
    want_loss, _, (want_dh, _), _ = run(**x)

    mesh = jax.make_mesh(mesh_shape, ("dp", "fsdp", "mp"), axis_types=(jax.sharding.AxisType.Auto,) * 3)
    specs = {"h": batch_spec, "w": w_spec, "targets": batch_spec, "mask": batch_spec}
    with jax.set_mesh(mesh):
        placed = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in x.items()}
        loss, _, (dh, _), _ = run(**placed)
        hlo = run.lower(**placed).compile().as_text()
    assert_close(loss, want_loss)
    assert_close(dh, want_dh)
    rows_per_device = p.batch // (mesh_shape[0] * mesh_shape[1])
    assert dh.sharding.shard_shape(dh.shape)[0] == rows_per_device
    assert all(str(p.vocab) not in dims for dims in gathered_dims(hlo)), gathered_dims(hlo)


@pytest.mark.parametrize("lm_head_lora, chunk, path", [(False, 2048, "frozen"), (False, 5, "frozen"),
                                                     (True, 2048, "plain"), (True, 5, "chunked"),
                                                     (False, 0, "plain")])
def test_finetune_takes_the_cheapest_head_loss_and_the_plain_losses_and_gradients(lm_head_lora, chunk, path,
                                                                                  monkeypatch):
    """`finetune.step.lm_head.batch_token_losses`, which SFT's loss and the preference objectives both take: a head
    without LoRA takes the frozen-head loss whenever there is a chunk, even a sequence of at most `chunk` positions;
    a head with LoRA the plain loss there and the rematerialised chunks beyond. Through SFT's `loss_sums`, the loss
    and the LoRA gradients are the plain loss's (`chunk` 0)."""
    import finetune.step.lm_head as lm_head
    import finetune.step.train_step as train_step

    calls = []
    for name, label in (("frozen_head_token_losses", "frozen"), ("token_losses", "plain"),
                        ("chunked_token_losses", "chunked")):
        monkeypatch.setattr(lm_head, name, functools.partial(
            lambda f, label, *a, **k: calls.append(label) or f(*a, **k), getattr(lm_head, name), label))
    config = ModelConfig(vocab_size=72, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    targets = ("q_proj", "lm_head") if lm_head_lora else ("q_proj",)
    model = apply_lora(CausalLM(config, rngs=nnx.Rngs(0)), LoraConfig(targets=targets), rngs=nnx.Rngs(1))
    graphdef, lora, base = nnx.split(model, LoRAParam, ...)
    lora = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(jax.random.key(2), x.shape, x.dtype), lora)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, 72, (2, 12)), jnp.int32)
    batch = {"input_ids": ids, "targets": jnp.roll(ids, -1, 1),
             "loss_mask": jnp.asarray(rng.random((2, 12)) < 0.7, jnp.float32),
             "segment_ids": jnp.ones_like(ids), "positions": jnp.broadcast_to(jnp.arange(12), (2, 12))}

    def loss(lora, chunk):
        return train_step.loss_sums(nnx.merge(graphdef, base, lora), batch, chunk=chunk)[0]

    def grad(chunk):  # a jit of its own each time: each call traces
        return jax.jit(jax.value_and_grad(loss), static_argnums=1)(lora, chunk)

    want_loss, want = grad(0)
    calls.clear()
    got_loss, got = grad(chunk)
    assert calls == [path]
    assert_close(got_loss, want_loss)
    for (_, g), (_, w) in zip(nnx.to_flat_state(got), nnx.to_flat_state(want)):
        assert float(jnp.max(jnp.abs(w[...]))) > 0
        assert_close(g[...], w[...])
