"""The suite's own machinery (tests/conftest.py, tests/timing.py, tests/durations.py): the fast tier's guard, what is
built once a session, and the durations table."""

import subprocess
import sys

import jax

import conftest
import durations


def fast_tier_findings(action) -> list[str]:
    """What the fast tier's guard notes while `action()` runs as if in a fast-tier test (this test's own findings are
    set back afterwards, so that it passes)."""
    saved = dict(conftest._FAST_TIER)
    conftest._FAST_TIER.update(test="tests/test_x.py::test_y", found=[])
    try:
        action()
        return list(conftest._FAST_TIER["found"])
    finally:
        conftest._FAST_TIER.update(saved)


def test_the_fast_tier_guard_notes_python_processes_only():
    found = fast_tier_findings(lambda: subprocess.run([sys.executable, "-c", "pass"], check=True))
    assert found == [f"started a Python process ({sys.executable})"]
    assert fast_tier_findings(lambda: subprocess.run(["true"], check=True)) == []


def test_the_fast_tier_guard_notes_a_train_step_compiled_and_nothing_else():
    def train_step(x):
        return x + 1

    def loss(x):
        return x * 2

    assert fast_tier_findings(lambda: jax.jit(loss)(1.0)) == []
    assert fast_tier_findings(lambda: jax.jit(train_step)(1.0)) == ["compiled a train step"]


def test_the_train_steps_are_named_as_the_guard_looks_for_them():
    from finetune.step.preference import Objective
    from finetune.step.train_step import build_preference_steps, build_steps

    assert build_steps(None, None, None, 1)[0].__name__ == "train_step"
    dpo = Objective("dpo", beta=0.1, label_smoothing=0.0, simpo_gamma=0.0, orpo_lambda=0.0, reference="base")
    assert build_preference_steps(None, None, None, dpo, 2, 1)[0].__name__ == "train_step"


def test_what_is_built_once_is_built_once_and_whole(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMA_JAX_TEST_SHARED", str(tmp_path))
    builds = []

    def build(out):
        builds.append(out)
        out.mkdir()
        (out / "done").write_text("yes")

    first, second = conftest.built_once("thing", build), conftest.built_once("thing", build)
    assert first == second == tmp_path / "thing" and len(builds) == 1
    assert (first / "done").read_text() == "yes" and not (tmp_path / "thing.partial").exists()


def test_the_durations_table_sums_each_file():
    records = [{"test": "tests/test_a.py::test_1", "wall_s": 3.0, "compile_s": 1.5, "children_cpu_s": 0.0},
               {"test": "tests/test_a.py::test_2", "wall_s": 1.0, "compile_s": 0.5, "children_cpu_s": 2.0},
               {"test": "tests/test_b.py::test_3", "wall_s": 2.0, "compile_s": 0.0, "children_cpu_s": 0.0}]
    lines = durations.tables(records).splitlines()
    file_a, file_b = "| `tests/test_a.py` | 2 | 4 | 50% | 50% |", "| `tests/test_b.py` | 1 | 2 | 0% | 0% |"
    assert lines.index(file_a) < lines.index(file_b)  # the slower file first
    assert lines[0].startswith("3 tests; wall 0.1 test-minutes")
