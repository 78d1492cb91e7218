"""The prompts an online RL run samples completions of: --data's prompts (layout prompt-only) tokenized in the store,
taken in the run's seeded epochs, each with its dataset row, whose prompt and other columns the rewards read.

Generation batch `k` holds the prompts at positions `k*B .. k*B+B-1` of the seeded epochs
(`finetune.data.order.row_indices`): a pure function of (seed, k), as every run's batches are.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from finetune.data.order import row_indices
from finetune.data.sources import DataSource
from finetune.data.store import TokenizedData


@dataclasses.dataclass(frozen=True)
class PromptRows:
    """The prompts of a set of dataset rows: the training rows, or the held-out ones."""

    store: TokenizedData  # one example a dataset row: its prompt's tokens, nothing trained
    examples: np.ndarray  # int64: the dataset rows of this set
    source: DataSource

    def __len__(self) -> int:
        return len(self.examples)

    def batch_rows(self, seed: int, k: int, prompts: int) -> np.ndarray:
        """The dataset rows of generation batch `k` of `prompts` prompts (the seeded epochs)."""
        return self.examples[row_indices(len(self), seed, k, prompts)]

    def eval_rows(self) -> np.ndarray:
        """Every dataset row of the set, in order (evaluation)."""
        return self.examples

    def token_ids(self, rows: np.ndarray) -> list[list[int]]:
        """The prompt tokens of each dataset row of `rows`."""
        starts = self.store.starts
        return [self.store.ids[starts[r]:starts[r + 1]].tolist() for r in rows]

    def columns(self, rows: np.ndarray) -> dict[str, list[Any]]:
        """Each column of the dataset (the prompt too) at `rows`, as lists: what a reward function is given. A
        message's fields a table filled with None (those other messages have) are left out, as they were when the
        prompt was tokenized."""
        table = self.source.dataset[[int(r) for r in rows]] if len(rows) else {
            name: [] for name in self.source.dataset.column_names}
        return {name: [_present(v) for v in values] if name == "prompt" else list(values)
                for name, values in table.items()}

    def where(self, row: int) -> str:
        return self.source.where(int(row))

    def longest(self) -> int:
        """The most tokens a prompt of this set has."""
        lengths = self.store.lengths()[self.examples]
        return int(lengths.max()) if len(lengths) else 0


def held_out_prompts(store: TokenizedData, examples: np.ndarray, n: int) -> list[tuple[list[int], list[int]]]:
    """(prompt tokens, reference completion tokens) of the first `n` held-out rows of a store of SFT rows or
    preference pairs (`examples`: their rows) that have a prompt: the tokens before the first trained one, and the
    trained span that follows (a pair's chosen reply). Rows trained from their first token (text) have none."""
    out = []
    for row in examples:
        example = store.example(int(row) * store.examples_per_row)  # a pair's chosen reply is its first example
        trained = np.flatnonzero(example.trained)
        if not len(trained) or trained[0] == 0:
            continue
        start = int(trained[0])
        end = start + int(np.argmin(np.append(example.trained[start:], False)))  # the first span's end
        out.append((example.ids[:start].tolist(), example.ids[start:end].tolist()))
        if len(out) == n:
            break
    return out


def _present(prompt: Any) -> Any:
    """A messages prompt without the None fields a table gives its messages."""
    if isinstance(prompt, list):
        return [{k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m for m in prompt]
    return prompt
