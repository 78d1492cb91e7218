"""The LM head's loss per target token of a batch, by the cheapest of `jaxmodel.loss`'s paths for the model and
`--loss-chunk`: the one choice that SFT's loss (`train_step.loss_sums`, their masked sum) and the preference
objectives' log-probabilities (`preference.token_logps`, their negation) both take."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmodel import scopes
from jaxmodel.context_parallel import cp_size, rows_over_cp
from jaxmodel.loss import chunked_token_losses, frozen_head_token_losses, token_losses


def batch_token_losses(model, batch: dict[str, jax.Array], names: tuple[str, ...] = (), *, dropout_key=None,
                       chunk: int = 0, router_stats: bool = False, temperature: float = 1.0) -> tuple[jax.Array, ...]:
    """(`-log p(target)` float32 `[rows, seq]`, then `batch[name]` for each of `names`), the positions in the
    model's order; with `router_stats`, then the routing's `jaxmodel.moe.RouterStats` of the same forward pass.
    With `temperature`, p is the softmax of the logits divided by it (a policy's sampling distribution before any
    top-k or top-p cut): the hidden states are divided instead, which the linear head makes the same.

    With `chunk`, the LM head runs over chunks of at most that many positions, so `[rows, seq, vocab]` logits are
    never held at once: a frozen head (no LoRA on `lm_head`) computes each chunk's logits once
    (`frozen_head_token_losses`, at any sequence length); a head with LoRA runs a scan whose body is
    rematerialised (`chunked_token_losses`), or, for a sequence of at most `chunk` positions, the plain loss, which
    needs fewer temporaries. Under context parallelism the positions come in the cp order and each device's part of
    a row becomes a row of its own, so that no chunk crosses devices: sums over positions do not care."""
    h_btd = model.hidden_states(batch["input_ids"], positions=batch["positions"], segment_ids=batch["segment_ids"],
                                dropout_key=dropout_key, router_stats=router_stats)
    h_btd, stats = h_btd if router_stats else (h_btd, None)
    if temperature != 1.0:
        h_btd = (h_btd / temperature).astype(h_btd.dtype)
    arrays = [batch["targets"], *(batch[name] for name in names)]
    rules = model.rules
    order = model.sequence_order(h_btd.shape[1])
    if order is not None:
        b, t, _ = h_btd.shape
        cp = cp_size()
        arrays = [jnp.take(x, order, axis=1).reshape(b * cp, t // cp) for x in arrays]
        h_btd = h_btd.reshape(b * cp, t // cp, h_btd.shape[2])
        rules = rows_over_cp(rules)
    targets_bt, *rest = arrays
    with jax.named_scope(scopes.LM_HEAD):
        w_vd = model.frozen_head_weight() if chunk else None
        if w_vd is not None:
            losses_bt = frozen_head_token_losses(h_btd, w_vd, targets_bt, chunk=chunk, rules=rules)
        elif not chunk or chunk >= h_btd.shape[1]:
            losses_bt = token_losses(model.head(h_btd), targets_bt)
        else:
            losses_bt = chunked_token_losses(model.head, h_btd, targets_bt, chunk=chunk, rules=rules)
    return (losses_bt, *rest) + ((stats,) if router_stats else ())
