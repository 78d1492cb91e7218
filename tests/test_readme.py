"""The README's Quick start holds exactly two one-line commands; CI runs the second verbatim."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def quick_start_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash", 1)[1].split("```", 1)[0]
    return [line.strip() for line in block.strip().splitlines() if line.strip()]


def test_quick_start_has_two_commands_and_ci_runs_the_second():
    demo, tests = quick_start_commands()
    assert "constraints.txt" in demo and "llama-jax-demo" in demo
    assert "tox" in tests
    ci = (ROOT / ".ci" / "run").read_text()
    assert tests in ci.splitlines()


def test_torch_is_pinned_wherever_it_is_installed():
    assert "torch==2.13.0" in (ROOT / "constraints.txt").read_text().splitlines()
    assert "PIP_CONSTRAINT = {toxinidir}/constraints.txt" in (ROOT / "tox.ini").read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    core = pyproject.split("dependencies = [", 1)[1].split("]", 1)[0]
    assert "torch" not in core and "transformers" not in core  # torch stays optional
