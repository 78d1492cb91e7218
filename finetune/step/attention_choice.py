"""The attention path of a run: `--attention` resolved for its backend and shapes, a fused kernel checked before
its first use (`jaxmodel.fused_attention`), the same decision on every process, and the lines that say why.

`auto` takes, on a GPU, the first kernel of its platform's (`jaxmodel.fused_attention.KERNELS_ON`) that can take the
run and agrees with the portable path; elsewhere (and where none does) the portable path
`TrainConfig.portable_attention` names. A kernel named by `--attention` is taken where it can take the run and
agrees; otherwise the portable path serves the run, said in one line.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from finetune.config import TrainConfig
from jaxmodel.config import ModelConfig
from jaxmodel.attention_check import disagreement
from jaxmodel.fused_attention import FUSED_IMPLS, KERNELS_ON, AttentionCall, kernel_platform, refusal


@dataclasses.dataclass(frozen=True)
class AttentionChoice:
    impl: str  # what the model runs
    why: str  # one line for the run's first lines
    weighed: bool = True  # whether a kernel was weighed: a run says why only then


def attention_call(config: TrainConfig, llama: ModelConfig, cp: int) -> AttentionCall:
    """The static facts of this run's attention calls."""
    return AttentionCall(dtype=config.dtype, head_dim=llama.head_dim, heads=llama.num_attention_heads,
                         kv_heads=llama.num_key_value_heads, q_len=config.seq_len // max(cp, 1),
                         kv_len=config.seq_len, q_offset=cp > 1, window=any(llama.layer_windows()),
                         packed=config.pack)


def choose_attention(config: TrainConfig, llama: ModelConfig, cp: int, platform: str | None = None,
                     check=disagreement) -> AttentionChoice:
    """The attention path of this run on `platform` (`kernel_platform`'s name; default: the default device's),
    each fused candidate checked once by `check(impl, call)` (a reason it is not taken, or None)."""
    platform = platform or kernel_platform()
    portable = config.portable_attention(cp)
    call = attention_call(config, llama, cp)
    if config.attention in FUSED_IMPLS:
        candidates, fallback = (config.attention,), f"{portable} serves the run"
    elif config.attention == "auto" and platform in KERNELS_ON:
        candidates, fallback = KERNELS_ON[platform], f"auto takes {portable}"
    else:
        why = "--attention" if config.attention != "auto" else f"auto on {platform}"
        return AttentionChoice(portable, f"attention: {portable} ({why})", weighed=False)
    reasons = []
    for impl in candidates:
        elsewhere = platform in KERNELS_ON and impl not in KERNELS_ON[platform]
        reason = (f"not a kernel for {platform}" if elsewhere else None) or refusal(impl, call) or check(impl, call)
        if reason is None:
            return agreed(AttentionChoice(impl, f"attention: {impl} (agrees with the portable path on a check of "
                                                f"this run's heads in {call.dtype})"), portable)
        reasons.append(f"{impl}: {reason}")
    return agreed(AttentionChoice(portable, f"attention: {fallback}; not taken: {'; '.join(reasons)}"), portable)


def agreed(choice: AttentionChoice, portable: str) -> AttentionChoice:
    """`choice` where every process of the run made it, else the portable path: processes that compiled different
    attention would run different programs."""
    if jax.process_count() == 1:
        return choice
    from jax.experimental import multihost_utils

    mine = np.int32((*FUSED_IMPLS, portable).index(choice.impl))
    every = np.asarray(multihost_utils.process_allgather(mine))
    if np.all(every == mine):
        return choice
    return AttentionChoice(portable, f"attention: {portable} (the processes' checks differed: "
                                     f"{sorted({(*FUSED_IMPLS, portable)[i] for i in every.ravel()})})")
