"""Reward functions (finetune.rollout.rewards): a TRL-style function from a user's file called with TRL's keyword
arguments, None as not applicable, the built-ins, and one-line errors naming the function and the row."""

import math
import textwrap

import numpy as np
import pytest

from finetune.config import ConfigFileError
from finetune.rollout.rewards import RewardError, TrainerState, load_reward, score

STATE = TrainerState(global_step=3, max_steps=10, epoch=0.5)
TRL_STYLE = '''
import re

def format_reward(completions, **kwargs):
    """TRL's documented example: a <think>...</think><answer>...</answer> format check."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    contents = [completion[0]["content"] for completion in completions]
    return [1.0 if re.match(pattern, content) else 0.0 for content in contents]

def seen(prompts, completions, completion_ids, solution, trainer_state, log_metric, **kwargs):
    log_metric("calls", 1.0)
    return [None if s is None else float(len(ids)) + trainer_state.global_step
            for s, ids in zip(solution, completion_ids)]

def short(completions, **kwargs):
    return [1.0]

def picky(completions, **kwargs):
    return [1.0 / (len(c) - 3) for c in completions]
'''


@pytest.fixture
def rewards_file(tmp_path):
    path = tmp_path / "rewards.py"
    path.write_text(textwrap.dedent(TRL_STYLE))
    return path


def chat(text):
    return [{"role": "assistant", "content": text}]


def test_a_trl_reward_function_runs_unchanged_with_trls_arguments(rewards_file):
    logged = []
    completions = [chat("<think>a</think><answer>4</answer>"), chat("4"), chat("<think>b</think><answer>5</answer>")]
    got = score([load_reward(f"{rewards_file}:format_reward"), load_reward(f"{rewards_file}:seen")],
                prompts=[[{"role": "user", "content": "2+2?"}]] * 3, completions=completions,
                completion_ids=[[1, 2], [3], [4, 5, 6]], columns={"solution": ["4", None, "5"]}, state=STATE,
                rows=["p.jsonl:7", "p.jsonl:7", "p.jsonl:8"],
                log_metric=lambda name, value: logged.append((name, value)))
    assert got.dtype == np.float32 and got.shape == (3, 2)
    np.testing.assert_array_equal(got[:, 0], [1.0, 0.0, 1.0])
    assert got[0, 1] == 5.0 and math.isnan(got[1, 1]) and got[2, 1] == 6.0
    assert logged == [("calls", 1.0)]


@pytest.mark.parametrize("spec, completions, column, expected", [
    ("equals:answer", ["  42\n", "41", chat("42")], ["42", "42", "42"], [1.0, 0.0, 1.0]),
    ("regex:^<answer>\\d+</answer>", ["<answer>12</answer> done", "answer 12", "<answer>\n</answer>"], None,
     [1.0, 0.0, 0.0]),
    ("last-number:answer", ["so 3 then 1,234", "it is -2.5.", "none", "7 and 8"], ["1234", -2.5, "3", "#### 8"],
     [1.0, 1.0, 0.0, 1.0]),
])
def test_the_built_in_rewards(spec, completions, column, expected):
    columns = {} if column is None else {"answer": column}
    got = score([load_reward(spec)], prompts=["q"] * len(completions), completions=completions,
                completion_ids=[[1]] * len(completions), columns=columns, state=STATE,
                rows=[f"p.jsonl:{i}" for i in range(len(completions))])
    np.testing.assert_array_equal(got[:, 0], expected)


def test_a_reward_returning_the_wrong_count_is_named_in_one_line(rewards_file):
    with pytest.raises(RewardError, match=r"^reward .*rewards\.py:short: returned 1 rewards for 2 completions "
                                          r"\(p.jsonl:4\)$"):
        score([load_reward(f"{rewards_file}:short")], prompts=["a", "b"], completions=["x", "y"],
              completion_ids=[[1], [2]], columns={}, state=STATE, rows=["p.jsonl:4", "p.jsonl:5"])


def test_a_reward_that_raises_names_the_first_row_it_fails_on(rewards_file):
    """The batch fails; scored alone, the completion of dataset row 12 (length 3) is the one that divides by 0."""
    with pytest.raises(RewardError, match=r"^reward .*:picky: ZeroDivisionError: .* \(p.jsonl:12\)$"):
        score([load_reward(f"{rewards_file}:picky")], prompts=["a"] * 3, completions=["abcdef", "abc", "abcd"],
              completion_ids=[[1]] * 3, columns={}, state=STATE, rows=["p.jsonl:11", "p.jsonl:12", "p.jsonl:12"])


def test_a_built_in_naming_a_missing_column_names_it():
    with pytest.raises(RewardError, match=r"reward equals:answer: KeyError: .*no column 'answer'.*p.jsonl:1"):
        score([load_reward("equals:answer")], prompts=["a"], completions=["x"], completion_ids=[[1]],
              columns={"solution": ["x"]}, state=STATE, rows=["p.jsonl:1"])


@pytest.mark.parametrize("spec, message", [
    ("nofile.py:f", "no file nofile.py"), ("rewards", "expected path/to/file.py:function"),
    ("{file}:absent", "defines no function 'absent'"), ("{broken}:f", "failed to load: SyntaxError"),
    ("regex:([", "not a regular expression"), ("equals:", "name the dataset column")])
def test_a_bad_reward_spec_is_one_line_naming_it(rewards_file, tmp_path, spec, message):
    broken = tmp_path / "broken.py"
    broken.write_text("def f(:\n")
    spec = spec.format(file=rewards_file, broken=broken)
    with pytest.raises(ConfigFileError) as info:
        load_reward(spec)
    assert str(info.value).startswith(f"--reward {spec!r}: ") and message in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.slow
def test_the_reward_file_of_the_docs_runs_under_trl_as_here(tiny_checkpoint, tmp_path):
    """docs/rl.md's reward file, called by TRL 1.16's GRPOTrainer (`_calculate_rewards`) and by `score` on the same
    chat prompts, completions and column: the same rewards, None as NaN in both."""
    import re
    from pathlib import Path

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    doc = (Path(__file__).resolve().parent.parent / "docs" / "rl.md").read_text()
    (tmp_path / "rewards.py").write_text(re.search(r"```python\n(.*?)```", doc, re.DOTALL).group(1))
    rewards = [load_reward(f"{tmp_path / 'rewards.py'}:{name}") for name in ("brief", "correct")]
    prompts = [[{"role": "user", "content": "2 + 3?"}]] * 2 + [[{"role": "user", "content": "4 + 4?"}]] * 2
    texts = ["5", "It is 6, I think, or more: the sum of two and three is five", "no idea", "8"]
    completions = [[{"role": "assistant", "content": t}] for t in texts]
    completion_ids = [[5, 2], list(range(6, 30)), [7, 8, 2], [9, 2]]
    answers = ["5", "5", "8", "8"]
    ours = score(rewards, prompts, completions, completion_ids, {"answer": answers}, STATE,
                 [f"p.jsonl:{i}" for i in range(4)])
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32),
                          reward_funcs=[r.function for r in rewards], processing_class=AutoTokenizer.from_pretrained(
                              tiny_checkpoint),
                          args=GRPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=4,
                                          num_generations=2, report_to=[], use_cpu=True, bf16=False),
                          train_dataset=Dataset.from_dict({"prompt": prompts[::2], "answer": answers[::2]}))
    inputs = [{"prompt": p, "answer": a} for p, a in zip(prompts, answers)]
    theirs = trainer._calculate_rewards(inputs, prompts, completions, completion_ids).numpy()
    np.testing.assert_array_equal(ours, theirs)
    assert np.isnan(ours[2, 1]) and ours[:, 0].tolist() == [1.0, 0.0, 1.0, 1.0] and ours[0, 1] == 1.0


def test_a_column_named_as_a_trl_argument_is_shadowed_by_it(rewards_file):
    """A dataset column `trainer_state` (or `completions`...) does not collide with TRL's own arguments: the
    function gets TRL's, as in TRL; every other column still arrives."""
    logged = []
    got = score([load_reward(f"{rewards_file}:seen")], prompts=["p"], completions=["c"], completion_ids=[[1, 2]],
                columns={"solution": ["x"], "trainer_state": ["a column"], "log_metric": ["another"],
                         "completions": ["a third"]}, state=STATE, rows=["p.jsonl:1"],
                log_metric=lambda name, value: logged.append(name))
    assert got[0, 0] == 2 + STATE.global_step and logged == ["calls"]
