"""The preference step against independent computations: each sequence's log-probability from a plain forward
pass of that sequence alone (numpy log-softmax), the objectives' formulas written out in numpy, DPO's ln 2 at a
zero adapter, and the same loss and gradients however the pairs are split over micro-batches."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from finetune.config import TrainConfig
from finetune.step.preference import Objective
from finetune.step.train_step import preference_loss_and_grads, split_model
from jaxmodel import load_pretrained
from jaxmodel.lora import ALL_TARGETS, LoraConfig, apply_lora, target_linears

SEQ_LEN = 24


def pairs_of(rng, n: int, vocab: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """(chosen ids, chosen trained, rejected ids, rejected trained): a shared prompt, then each completion."""
    out = []
    for _ in range(n):
        prompt = rng.integers(6, vocab, rng.integers(2, 8))
        sides = []
        for _ in range(2):
            completion = rng.integers(6, vocab, rng.integers(1, 10))
            ids = np.concatenate([prompt, completion]).astype(np.int32)
            sides += [ids, np.arange(len(ids)) >= len(prompt)]
        out.append(tuple(sides))
    return out


def unpacked_batch(pairs, grad_accum: int, slots: int | None = None) -> dict[str, np.ndarray]:
    """The pair rows of one step of `slots` pair slots (default: one per pair; those past the pairs are empty
    pairs, rows of padding), one sequence per row, laid out as `finetune.data.pairs.PairRows` lays them (one
    batch shard): pair j goes to micro-batch j % accum as its pair i = j // accum, its chosen sequence in the
    micro-batch's row 2 i (slot 2 i), its rejected in row 2 i + 1 (slot 2 i + 1)."""
    rows = 2 * (len(pairs) if slots is None else slots)
    batch = {k: np.zeros((rows, SEQ_LEN), np.int32) for k in ("input_ids", "targets", "segment_ids", "positions")}
    batch["loss_mask"] = np.zeros((rows, SEQ_LEN), np.float32)
    batch["sequence"] = np.full((rows, SEQ_LEN), -1, np.int32)
    for j, (ic, tc, ir, tr) in enumerate(pairs):
        m, i = j % grad_accum, j // grad_accum
        for c, (ids, trained) in enumerate(((ic, tc), (ir, tr))):
            r = m + grad_accum * (2 * i + c)
            n = len(ids)
            batch["input_ids"][r, :n] = ids
            batch["targets"][r, :n - 1] = ids[1:]
            batch["loss_mask"][r, :n - 1] = trained[1:]
            batch["segment_ids"][r, :n] = 1
            batch["positions"][r, :n] = np.arange(n)
            batch["sequence"][r, :n] = 2 * i + c
    return batch


def sequence_logp(model, ids: np.ndarray, trained: np.ndarray) -> tuple[float, int]:
    """(sum of log p(token) over the trained tokens after the first, their number), from the sequence alone."""
    logits = np.asarray(model(jnp.asarray(ids[None])), np.float64)[0]
    logp = logits - np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    picked = logp[np.arange(len(ids) - 1), ids[1:]]
    return float(np.sum(picked[trained[1:]])), int(np.sum(trained[1:]))


def log_sigmoid(x):
    return -np.logaddexp(0.0, -x)


def expected_loss(objective: str, policy, reference, beta=0.1, e=0.0, gamma=0.5, lam=0.1) -> float:
    """The objectives' definitions (docs/preference-tuning.md) over per-pair (logp, count) of policy and reference."""
    losses = []
    for (lc, nc, lr, nr), (rc, _, rr, _) in zip(policy, reference):
        ac, ar = lc / nc, lr / nr
        if objective == "dpo":
            d = (lc - rc) - (lr - rr)
            losses.append(-(1 - e) * log_sigmoid(beta * d) - e * log_sigmoid(-beta * d))
        elif objective == "ipo":
            losses.append(((ac - rc / nc) - (ar - rr / nr) - 1 / (2 * beta)) ** 2)
        elif objective == "simpo":
            losses.append(-log_sigmoid(beta * (ac - ar) - gamma))
        else:
            log_odds = (ac - ar) - (np.log1p(-np.exp(ac)) - np.log1p(-np.exp(ar)))
            losses.append(-ac - lam * log_sigmoid(log_odds))
    return float(np.mean(losses))


@pytest.fixture(scope="module")
def models(tiny_converted):
    """(the tiny model with adapters whose B is non-zero, the same model with B = 0)."""
    adapted = apply_lora(load_pretrained(tiny_converted, dtype=jnp.float32), LoraConfig(rank=4, alpha=8),
                         rngs=nnx.Rngs(1))
    plain = apply_lora(load_pretrained(tiny_converted, dtype=jnp.float32), LoraConfig(rank=4, alpha=8),
                       rngs=nnx.Rngs(1))
    for i, (_, linear) in enumerate(target_linears(adapted, ALL_TARGETS)):
        linear.lora_b.set_value(0.05 * jax.random.normal(jax.random.key(i), linear.lora_b[...].shape))
    return adapted, plain


def step_result(model, batch, objective: Objective, pairs: int, grad_accum: int):
    graphdef, lora, base = split_model(model)
    return preference_loss_and_grads(graphdef, lora, base, None, {k: jnp.asarray(v) for k, v in batch.items()},
                                     objective, pairs, grad_accum)


def objective(name: str, **kw) -> Objective:
    return Objective.of(TrainConfig(model="m", data="d", out="o", objective=name, **kw).validate())


@pytest.mark.slow
@pytest.mark.parametrize("name,kw", [("dpo", {}), ("dpo", {"label_smoothing": 0.2}), ("ipo", {}),
                                     ("simpo", {"beta": 2.0}), ("orpo", {})])
def test_the_loss_is_the_objectives_formula_over_each_sequence_alone(models, name, kw):
    adapted, plain = models
    pairs = pairs_of(np.random.default_rng(0), 4, 200)
    loss, metrics, _ = step_result(adapted, unpacked_batch(pairs, 1), objective(name, **kw), 4, 1)
    policy = [(*sequence_logp(adapted, ic, tc), *sequence_logp(adapted, ir, tr)) for ic, tc, ir, tr in pairs]
    reference = [(*sequence_logp(plain, ic, tc), *sequence_logp(plain, ir, tr)) for ic, tc, ir, tr in pairs]
    args = {"beta": kw.get("beta", 0.1), "e": kw.get("label_smoothing", 0.0)}
    expected = expected_loss(name, policy, reference, **args)
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    assert float(metrics["pairs"]) == 4
    assert float(metrics["logps/chosen"]) == pytest.approx(
        np.mean([p[0] if name in ("dpo", "ipo") else p[0] / p[1] for p in policy]), rel=1e-5)


@pytest.mark.slow
def test_dpo_at_a_zero_adapter_is_ln2_with_no_gradient_for_a(models):
    _, plain = models
    pairs = pairs_of(np.random.default_rng(1), 4, 200)
    loss, metrics, grads = step_result(plain, unpacked_batch(pairs, 1), objective("dpo"), 4, 1)
    # The policy is the reference; the two forward passes are compiled apart, so their logps agree to float32's
    # rounding, not bit for bit.
    assert abs(float(metrics["rewards/margins"])) < 1e-6 * abs(float(metrics["logps/chosen"]))
    assert float(loss) == pytest.approx(math.log(2.0), rel=1e-6)
    a_grads = [v for path, v in nnx.to_flat_state(grads) if "lora_a" in str(path)]
    b_grads = [v for path, v in nnx.to_flat_state(grads) if "lora_b" in str(path)]
    assert a_grads and all(float(jnp.max(jnp.abs(g[...]))) == 0.0 for g in a_grads)
    assert any(float(jnp.max(jnp.abs(g[...]))) > 0 for g in b_grads)


@pytest.mark.slow
def test_micro_batches_split_pairs_without_changing_loss_or_gradients(models):
    adapted, _ = models
    pairs = pairs_of(np.random.default_rng(2), 4, 200)
    one = step_result(adapted, unpacked_batch(pairs, 1), objective("dpo"), 4, 1)
    two = step_result(adapted, unpacked_batch(pairs, 2), objective("dpo"), 4, 2)
    assert float(two[0]) == pytest.approx(float(one[0]), rel=1e-6)
    g1, g2 = (jnp.concatenate([v[...].ravel() for _, v in nnx.to_flat_state(r[2])]) for r in (one, two))
    assert float(jnp.linalg.norm(g1 - g2) / jnp.linalg.norm(g1)) < 1e-5


@pytest.mark.slow
def test_pairs_weigh_alike_when_micro_batches_hold_different_numbers_of_pairs(models):
    """3 pairs in 4 slots over 2 micro-batches (pairs 0 and 2, then pair 1 and an empty slot): the loss is the mean
    over the 3 pairs, as one micro-batch of them gives it, not the mean of the micro-batches' means."""
    adapted, _ = models
    pairs = pairs_of(np.random.default_rng(3), 3, 200)
    one = step_result(adapted, unpacked_batch(pairs, 1), objective("dpo"), 3, 1)
    two = step_result(adapted, unpacked_batch(pairs, 2, slots=4), objective("dpo"), 4, 2)
    assert float(two[1]["pairs"]) == float(one[1]["pairs"]) == 3
    assert float(two[0]) == pytest.approx(float(one[0]), rel=1e-6)
    g1, g2 = (jnp.concatenate([v[...].ravel() for _, v in nnx.to_flat_state(r[2])]) for r in (one, two))
    assert float(jnp.linalg.norm(g1 - g2) / jnp.linalg.norm(g1)) < 1e-5
