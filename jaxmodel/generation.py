"""Text generation with a KV cache: one prefill over the prompt, then one cached step per new token, all inside a
single jit-compiled function, in a loop that ends when every row has stopped.

`sample` is the sampler: completions, each token's log-probability and each row's length, from the model's
parameters as they are (a LoRA adapter read where it lies, nothing merged), for rollouts and evaluation alike.
`generate` is its prompt-plus-completion form.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmodel.model import CausalLM


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How `sample` draws each new token: from the logits divided by `temperature` (0: the most likely token), kept
    to the `top_k` most likely (0: all), then to the smallest set whose probability reaches `top_p`, then to those at
    least `min_p` times as likely as the most likely: transformers' warpers in its order. A row stops after an `eos`
    token or a `stop` sequence of tokens (its last tokens), or at `max_new_tokens`; it holds `pad` from then on."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    eos: tuple[int, ...] = ()
    pad: int = 0
    stop: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {self.temperature}, {self.top_p}")
        if self.top_k < 0 or not 0 <= self.min_p <= 1:
            raise ValueError(f"need top_k >= 0 and 0 <= min_p <= 1, got {self.top_k}, {self.min_p}")
        if any(not sequence for sequence in self.stop):
            raise ValueError("a stop sequence needs at least one token")


class Samples(NamedTuple):
    """`sample`'s output: `tokens` `[b, n]` int32 (`pad` after a row stops), `logprobs` `[b, n]` float32 (each
    token's log-probability under the logits divided by the temperature, none of the top-k, top-p or min-p
    filtering, as TRL computes it; 0 after a row stops), `lengths` `[b]` int32 (each row's tokens, its stop
    token or sequence included)."""

    tokens: np.ndarray
    logprobs: np.ndarray
    lengths: np.ndarray


def sample(model: CausalLM, input_ids, sampling: Sampling, *, seed: int | jax.Array = 0,
           attention_mask=None) -> Samples:
    """Completions of the prompts `input_ids` `[b, t]` (left-padded, `attention_mask` marking their real tokens),
    drawn as `sampling` says from `seed` (an int, or a jax key: the same key draws the same tokens)."""
    ids = jnp.asarray(input_ids, jnp.int32)
    mask = jnp.ones_like(ids) if attention_mask is None else jnp.asarray(attention_mask, jnp.int32)
    key = jax.random.key(seed) if isinstance(seed, int) else seed
    graphdef, state = nnx.split(model)
    return Samples(*(np.asarray(x) for x in sample_arrays(graphdef, state, ids, mask, key, sampling)))


def generate(model: CausalLM, input_ids, max_new_tokens: int, *, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, attention_mask=None, eos_token_id: int | tuple[int, ...] | None = None,
             pad_token_id: int | None = None) -> np.ndarray:
    """Prompt plus `max_new_tokens` new tokens, `[b, t + max_new_tokens]`.

    `temperature == 0` decodes greedily; otherwise samples with nucleus `top_p` from `seed`. Prompts of
    unequal length are left-padded, with `attention_mask` marking real tokens. A row that emits an
    `eos_token_id` (default: the config's) is padded with `pad_token_id` from then on.
    """
    config = model.config
    eos = config.eos_token_ids if eos_token_id is None else tuple(np.atleast_1d(eos_token_id).tolist())
    pad = pad_token_id if pad_token_id is not None else (config.pad_token_id or 0)
    sampling = Sampling(max_new_tokens, float(temperature), float(top_p), eos=tuple(int(e) for e in eos), pad=pad)
    tokens = sample(model, input_ids, sampling, seed=seed, attention_mask=attention_mask).tokens
    return np.concatenate([np.asarray(input_ids, np.int32), tokens], axis=1)


@partial(jax.jit, static_argnames=("graphdef", "sampling"))
def sample_arrays(graphdef, state, ids_bt, mask_bt, key, sampling: Sampling):
    """`sample` on device: (tokens, logprobs, lengths) as jax arrays, for callers that keep them there; `state` the
    model's state, or a tuple of states (a run's LoRA and frozen parts) merged with `graphdef`. The draws of step i
    use `fold_in(key, i)`, so a row's tokens do not depend on how many steps the loop ran."""
    model = nnx.merge(graphdef, *state) if isinstance(state, tuple) else nnx.merge(graphdef, state)
    b, t = ids_bt.shape
    n = sampling.max_new_tokens
    cache = model.init_cache(b, t + n)
    positions_bt = jnp.maximum(jnp.cumsum(mask_bt, axis=1) - 1, 0)
    key_valid_bs = jnp.concatenate([mask_bt, jnp.ones((b, n), mask_bt.dtype)], axis=1)
    logits_b1v, cache = model.decode(ids_bt, positions_bt, key_valid_bs, cache, 0, last_only=True)
    eos_ids = jnp.asarray(sampling.eos or (-1,), jnp.int32)

    def pick(logits_bv, i, tokens_bn, logprobs_bn, lengths_b):
        done_b = lengths_b <= i
        token_b, logprob_b = _draw(logits_bv, jax.random.fold_in(key, i), sampling)
        token_b = jnp.where(done_b, sampling.pad, token_b)
        tokens_bn = tokens_bn.at[:, i].set(token_b)
        logprobs_bn = logprobs_bn.at[:, i].set(jnp.where(done_b, 0.0, logprob_b))
        stops_b = ~done_b & (jnp.isin(token_b, eos_ids) | _ends_with_stop(tokens_bn, i, sampling.stop))
        return tokens_bn, logprobs_bn, jnp.where(stops_b, i + 1, lengths_b)

    tokens_bn = jnp.full((b, n), sampling.pad, jnp.int32)
    logprobs_bn = jnp.zeros((b, n), jnp.float32)
    lengths_b = jnp.full((b,), n, jnp.int32)  # until a row stops
    tokens_bn, logprobs_bn, lengths_b = pick(logits_b1v[:, 0], 0, tokens_bn, logprobs_bn, lengths_b)

    def more(carry):
        i, lengths_b = carry[0], carry[-1]
        return jnp.any(lengths_b > i)

    def step(carry):
        i, cache, position_b, tokens_bn, logprobs_bn, lengths_b = carry
        logits_b1v, cache = model.decode(tokens_bn[:, i - 1, None], position_b[:, None], key_valid_bs, cache,
                                         t + i - 1)
        tokens_bn, logprobs_bn, lengths_b = pick(logits_b1v[:, 0], i, tokens_bn, logprobs_bn, lengths_b)
        return i + 1, cache, position_b + 1, tokens_bn, logprobs_bn, lengths_b

    init = (jnp.int32(1), cache, positions_bt[:, -1] + 1, tokens_bn, logprobs_bn, lengths_b)
    _, _, _, tokens_bn, logprobs_bn, lengths_b = jax.lax.while_loop(more, step, init)
    return tokens_bn, logprobs_bn, lengths_b


def _ends_with_stop(tokens_bn, i, stop: tuple[tuple[int, ...], ...]):
    """Whether each row's tokens up to position `i` end with one of the `stop` sequences, `[b]`."""
    b, n = tokens_bn.shape
    ended_b = jnp.zeros((b,), bool)
    for sequence in (s for s in stop if len(s) <= n):
        start = i - len(sequence) + 1
        window_bw = jax.lax.dynamic_slice_in_dim(tokens_bn, jnp.maximum(start, 0), len(sequence), axis=1)
        ended_b = ended_b | ((start >= 0) & jnp.all(window_bw == jnp.asarray(sequence, jnp.int32), axis=1))
    return ended_b


def _draw(logits_bv, key, sampling: Sampling):
    """A token of each row and its log-probability under `logits / temperature` (the greedy token's under the
    logits themselves at temperature 0)."""
    logits_bv = logits_bv.astype(jnp.float32)
    if sampling.temperature == 0.0:
        token_b = jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
        scaled_bv = logits_bv
    else:
        scaled_bv = logits_bv / sampling.temperature
        token_b = _inverse_cdf_draw(key, jax.nn.softmax(warped(scaled_bv, sampling), axis=-1))
    logprob_b = jnp.take_along_axis(jax.nn.log_softmax(scaled_bv, axis=-1), token_b[:, None], axis=1)[:, 0]
    return token_b, logprob_b


def _inverse_cdf_draw(key, probs_bv):
    """A token of each row drawn from `probs_bv`: the first whose cumulative probability passes a uniform draw
    (scaled to the row's float32 total). One random number a row: `jax.random.categorical`'s Gumbel noise for
    every token of a 49k vocabulary took 37 of the 94 ms of a draw at batch 64 on a CPU. A token of probability 0
    is never drawn."""
    cdf_bv = jnp.cumsum(probs_bv, axis=-1)
    u_b1 = jax.random.uniform(key, (probs_bv.shape[0], 1)) * cdf_bv[:, -1:]
    return jnp.minimum(jnp.sum(cdf_bv <= u_b1, axis=-1), probs_bv.shape[-1] - 1).astype(jnp.int32)


def warped(scaled_bv, sampling: Sampling):
    """The temperature-scaled logits `[b, v]` with the tokens top-k, top-p and min-p filter out at -inf, each filter
    applied to what the one before left (transformers' `TopKLogitsWarper`, `TopPLogitsWarper`, `MinPLogitsWarper`,
    each keeping at least the most likely token)."""
    if sampling.top_k and sampling.top_k < scaled_bv.shape[-1]:
        kth_b = jax.lax.top_k(scaled_bv, sampling.top_k)[0][:, -1]
        scaled_bv = jnp.where(scaled_bv < kth_b[:, None], -jnp.inf, scaled_bv)
    if sampling.top_p < 1.0:
        # Keep the smallest set of most likely tokens whose probability reaches top_p.
        sorted_bv = jnp.sort(scaled_bv, axis=-1)[:, ::-1]
        probs_bv = jax.nn.softmax(sorted_bv, axis=-1)
        before_bv = jnp.cumsum(probs_bv, axis=-1) - probs_bv
        threshold_b = jnp.min(jnp.where(before_bv < sampling.top_p, sorted_bv, jnp.inf), axis=-1)
        scaled_bv = jnp.where(scaled_bv < threshold_b[:, None], -jnp.inf, scaled_bv)
    if sampling.min_p > 0.0:
        probs_bv = jax.nn.softmax(scaled_bv, axis=-1)
        floor_b = sampling.min_p * jnp.max(probs_bv, axis=-1)
        scaled_bv = jnp.where(probs_bv < floor_b[:, None], -jnp.inf, scaled_bv)
    return scaled_bv
