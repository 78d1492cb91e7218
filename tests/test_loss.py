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
- sharding the batch (and the vocabulary) over 8 devices changes nothing but the layout.
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

from jaxmodel import LlamaConfig, LlamaForCausalLM
from jaxmodel.layers import LoRAParam
from jaxmodel.lora import LoraConfig, apply_lora
from jaxmodel.loss import chunked_cross_entropy_sums, cross_entropy_sums

F32_RTOL = 1e-5
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

    config = LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
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
    config = LlamaConfig(vocab_size=72, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    model = apply_lora(LlamaForCausalLM(config, rngs=nnx.Rngs(0)), LoraConfig(targets=("lm_head",)),
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
