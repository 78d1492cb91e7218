"""A generation batch's sampled completions as the rows a policy-gradient step trains on (`finetune.step.policy`'s
rollout batch), and the prompt lengths the sampler compiles for.

Each completion is one row: its prompt left-padded to the step's prompt bucket, then its completion (padded after its
stop): `[prompts x G, bucket + width]`, the width the longest completion's bucket (`completion_width`). Positions count the real tokens from 0, as the sampler's do, so the
training forward scores each token where it was drawn.
"""

from __future__ import annotations

import numpy as np

# Prompt lengths are padded up to one of these (then multiples of the largest), so that a run compiles the sampler
# for a handful of shapes rather than one per batch.
PROMPT_BUCKETS = (16, 32, 64, 128, 256, 512, 1024)


def prompt_bucket(longest: int) -> int:
    """The padded prompt length for a batch whose longest prompt has `longest` tokens."""
    for bucket in PROMPT_BUCKETS:
        if longest <= bucket:
            return bucket
    step = PROMPT_BUCKETS[-1]
    return -(-longest // step) * step


def completion_width(lengths: np.ndarray, most: int) -> int:
    """The completion positions a batch's rows keep: its longest completion's, padded up to a prompt bucket, at most
    `most` (--max-completion-length). Short completions train in short rows, and a run compiles its step for a
    handful of widths."""
    return min(most, prompt_bucket(max(int(np.max(lengths)), 1)))


def left_padded(prompts: list[list[int]], length: int, pad: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids, attention mask) `[len(prompts), length]` int32: each prompt right-aligned after `pad`s."""
    ids = np.full((len(prompts), length), pad, np.int32)
    mask = np.zeros((len(prompts), length), np.int32)
    for row, prompt in enumerate(prompts):
        if prompt:
            ids[row, length - len(prompt):] = prompt
            mask[row, length - len(prompt):] = 1
    return ids, mask


def rollout_rows(prompt_ids: np.ndarray, prompt_mask: np.ndarray, tokens: np.ndarray, lengths: np.ndarray,
                 advantages: np.ndarray, old_logps: np.ndarray | None = None, grad_accum: int = 1,
                 trained: np.ndarray | None = None, ref_logps: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The rollout batch of completions `tokens` `[n, new]` (`lengths` real tokens each) of the left-padded prompts
    `prompt_ids`/`prompt_mask` `[n, p]` (one row a completion): `input_ids`, `targets`, `loss_mask` (each completion
    token, at the position that predicts it; none for a row `trained` marks False: `mask_truncated_completions`),
    `segment_ids`, `positions`, `sequence` (the row's slot in its micro-batch of `grad_accum`: rows k, k + accum,
    ... form micro-batch k), `advantage` and, given the log-probabilities the completions were drawn with
    (`old_logps` `[n, new]`) or a reference's (`ref_logps`, precomputed), those, each at the target it scores."""
    n, p = prompt_ids.shape
    new = tokens.shape[1]
    real_completion = np.arange(new)[None, :] < lengths[:, None]
    ids = np.concatenate([prompt_ids, np.where(real_completion, tokens, 0)], axis=1).astype(np.int32)
    real = np.concatenate([prompt_mask.astype(bool), real_completion], axis=1)
    targets = np.concatenate([ids[:, 1:], np.zeros((n, 1), np.int32)], axis=1)
    loss_mask = np.zeros((n, p + new), np.float32)
    scored = real_completion & (np.ones(n, bool) if trained is None else np.asarray(trained, bool))[:, None]
    loss_mask[:, p - 1:p - 1 + new] = scored
    rows = {
        "input_ids": ids, "targets": targets, "loss_mask": loss_mask, "segment_ids": real.astype(np.int32),
        "positions": np.maximum(np.cumsum(real, axis=1) - 1, 0).astype(np.int32),
        "sequence": np.where(loss_mask > 0, (np.arange(n) // grad_accum)[:, None], -1).astype(np.int32),
        "advantage": np.where(loss_mask > 0, np.asarray(advantages, np.float32)[:, None], 0.0).astype(np.float32),
    }
    for name, logps in (("old_logps", old_logps), ("ref_logps", ref_logps)):
        if logps is not None:  # at the position that predicts each token
            at_targets = np.pad(np.asarray(logps, np.float32), ((0, 0), (p - 1, 1)))
            rows[name] = np.where(loss_mask > 0, at_targets, 0.0).astype(np.float32)
    return rows
