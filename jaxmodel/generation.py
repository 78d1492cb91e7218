"""Text generation with a KV cache: one prefill over the prompt, then one cached step per new token,
all inside a single jit-compiled function."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmodel.model import CausalLM


def generate(model: CausalLM, input_ids, max_new_tokens: int, *, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, attention_mask=None, eos_token_id: int | tuple[int, ...] | None = None,
             pad_token_id: int | None = None) -> np.ndarray:
    """Prompt plus `max_new_tokens` new tokens, `[b, t + max_new_tokens]`.

    `temperature == 0` decodes greedily; otherwise samples with nucleus `top_p` from `seed`. Prompts of
    unequal length are left-padded, with `attention_mask` marking real tokens. A row that emits an
    `eos_token_id` (default: the config's) is padded with `pad_token_id` from then on.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
    ids = jnp.asarray(input_ids, jnp.int32)
    mask = jnp.ones_like(ids) if attention_mask is None else jnp.asarray(attention_mask, jnp.int32)
    config = model.config
    eos = config.eos_token_ids if eos_token_id is None else tuple(np.atleast_1d(eos_token_id).tolist())
    pad = pad_token_id if pad_token_id is not None else (config.pad_token_id or 0)
    graphdef, state = nnx.split(model)
    out = _generate(graphdef, state, ids, mask, jax.random.key(seed), max_new_tokens=max_new_tokens,
                    temperature=float(temperature), top_p=float(top_p), eos=eos, pad=pad)
    return np.asarray(out)


@partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "temperature", "top_p", "eos", "pad"))
def _generate(graphdef, state, ids_bt, mask_bt, key, *, max_new_tokens, temperature, top_p, eos, pad):
    model = nnx.merge(graphdef, state)
    b, t = ids_bt.shape
    cache = model.init_cache(b, t + max_new_tokens)
    positions_bt = jnp.maximum(jnp.cumsum(mask_bt, axis=1) - 1, 0)
    key_valid_bs = jnp.concatenate([mask_bt, jnp.ones((b, max_new_tokens), mask_bt.dtype)], axis=1)
    logits_btv, cache = model.decode(ids_bt, positions_bt, key_valid_bs, cache, 0)
    eos_ids = jnp.asarray(eos if eos else (-1,), jnp.int32)

    def pick(logits_bv, key, done_b):
        token_b = _sample(logits_bv, key, temperature, top_p)
        token_b = jnp.where(done_b, pad, token_b)
        return token_b, done_b | jnp.isin(token_b, eos_ids)

    key, first_key = jax.random.split(key)
    first_b, done_b = pick(logits_btv[:, -1], first_key, jnp.zeros((b,), bool))

    def step(carry, i):
        cache, token_b, position_b, key, done_b = carry
        logits_b1v, cache = model.decode(token_b[:, None], position_b[:, None], key_valid_bs, cache, t + i)
        key, sub = jax.random.split(key)
        token_b, done_b = pick(logits_b1v[:, 0], sub, done_b)
        return (cache, token_b, position_b + 1, key, done_b), token_b

    init = (cache, first_b, positions_bt[:, -1] + 1, key, done_b)
    _, rest_nb = jax.lax.scan(step, init, jnp.arange(max_new_tokens - 1))
    return jnp.concatenate([ids_bt, first_b[:, None], rest_nb.T], axis=1)


def _sample(logits_bv, key, temperature: float, top_p: float):
    if temperature == 0.0:
        return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
    logits_bv = logits_bv / temperature
    if top_p < 1.0:
        # Keep the smallest set of most likely tokens whose probability reaches top_p.
        sorted_bv = jnp.sort(logits_bv, axis=-1)[:, ::-1]
        probs_bv = jax.nn.softmax(sorted_bv, axis=-1)
        before_bv = jnp.cumsum(probs_bv, axis=-1) - probs_bv
        threshold_b = jnp.min(jnp.where(before_bv < top_p, sorted_bv, jnp.inf), axis=-1)
        logits_bv = jnp.where(logits_bv < threshold_b[:, None], -jnp.inf, logits_bv)
    return jax.random.categorical(key, logits_bv, axis=-1).astype(jnp.int32)
