"""Every command line the docs show parses with the parser of the command it runs, so no doc can name a flag,
a choice or an option combination the code does not take.

Command lines are read from the ``` fences of README.md and docs/*.md: lines ending in `\\` are joined, a
leading `$ ` prompt, leading `NAME=value` assignments and a leading `.venv/bin/` are stripped, `a && b`,
`a; b` and `a | b` are split, `srun ... CMD` and `bash -c '...'` are looked through, and a shell variable
standing alone as a word (`$SLURM_PROCID`) is read as `1`. A line is a case when it starts with
`convert-llama`, `finetune-lora`, `export-peft`, `llama-jax-demo` or `python bench/NAME.py`; each case is named
FILE:LINE. Nothing is run: lines that need a GPU node, the hub or real files are only parsed.

- finetune-lora: its argparse parser (finetune.config.build_parser) and load_config; without `--config`, the
  TrainConfig is built and `.validate()`d too (the checks that need no files). With `--config FILE.yaml` the
  flags are parsed only; the YAML files the docs show are checked by `test_docs_yaml_is_a_valid_config`.
- convert-llama, export-peft: their parsers (converter/cli.py, export/cli.py), and export-peft's own argument
  checks in main() (the work after them is stopped before it starts).
- llama-jax-demo: demo/cli.py's main() up to the demo itself; options after `--` parse as finetune-lora's.
- python bench/NAME.py: the script's `build_parser()`.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOOLS = ("convert-llama", "finetune-lora", "export-peft", "llama-jax-demo")
PYTHONS = ("python", "python3")
WRAPPERS = ("srun", "exec", "time", "nohup")  # words that run the command that follows them
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
VARIABLE = re.compile(r"^\$(\w+|\{\w+\})$")
BENCH = re.compile(r"^bench/(\w+)\.py$")


def fenced_lines(path: Path):
    """(line number, text) of every line inside ``` fences, continuation lines (`\\`) joined."""
    lines = path.read_text(encoding="utf-8").split("\n")
    inside, i = False, 0
    while i < len(lines):
        if lines[i].strip().startswith("```"):
            inside = not inside
            i += 1
            continue
        if inside:
            start, text = i, lines[i]
            while text.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                text = text.rstrip()[:-1] + " " + lines[i].strip()
            yield start + 1, text
        i += 1


def split_commands(text: str) -> list[list[str]]:
    """The simple commands of a shell line: words split as the shell would, `#` comments dropped."""
    text = text.strip().removeprefix("$ ")
    lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    try:
        words = list(lexer)
    except ValueError:  # not shell (e.g. prose or output with an unbalanced quote)
        return []
    commands, current = [], []
    for word in words:
        if word and set(word) <= set(";&|"):
            commands.append(current)
            current = []
        else:
            current.append(word)
    return [c for c in commands + [current] if c]


def tool_argv(words: list[str]) -> list[str] | None:
    """[command, args...] if `words` run one of the toolkit's commands (env, wrappers, .venv/bin/ stripped)."""
    while words and ASSIGNMENT.match(words[0]):
        words = words[1:]
    if not words:
        return None
    words = [w.removeprefix("./").removeprefix(".venv/bin/") for w in words[:1]] + words[1:]
    head = words[0]
    if head in ("bash", "sh") and len(words) >= 3 and words[1] == "-c":
        inner = [tool_argv(c) for c in split_commands(words[2])]
        return next((c for c in inner if c), None)
    if head in WRAPPERS:
        for i in range(1, len(words)):
            found = tool_argv(words[i:]) if not words[i].startswith("-") else None
            if found:
                return found
        return None
    if head in TOOLS:
        return [head] + [("1" if VARIABLE.match(w) else w) for w in words[1:]]
    if head in PYTHONS and len(words) >= 2 and BENCH.match(words[1]):
        return [words[1]] + [("1" if VARIABLE.match(w) else w) for w in words[2:]]
    return None


def doc_commands():
    cases = []
    for path in DOCS:
        for line, text in fenced_lines(path):
            found = [argv for argv in map(tool_argv, split_commands(text)) if argv]
            for n, argv in enumerate(found):
                name = f"{path.relative_to(ROOT)}:{line}" + (f"#{n + 1}" if len(found) > 1 else "")
                cases.append(pytest.param(argv, id=name))
    return cases


CASES = doc_commands()


def jax_started() -> bool:
    """Whether JAX has created its devices (importing jax does not); as finetune/cli.py asks it."""
    if "jax" not in sys.modules:
        return False
    from jax._src import xla_bridge

    return getattr(xla_bridge, "backends_are_initialized", lambda: False)()


class ParseError(Exception):
    pass


def strict(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`parser` raising ParseError (with argparse's message) where it would print usage and exit, and taking
    whole option names only: a doc's `--round` for `--rounds` works today and breaks when a `--round-x` comes."""
    def error(message):
        raise ParseError(f"{parser.prog}: {message}")

    parser.error = error
    parser.allow_abbrev = False
    return parser


class Stop(Exception):
    """Raised in place of a command's real work, once its arguments were accepted."""


def _stop(*args, **kwargs):
    raise Stop


def check_finetune(args: list[str]) -> None:
    from finetune.config import build_parser, load_config
    from finetune.step.mesh import parse_mesh

    parsed = strict(build_parser("finetune-lora", "")).parse_args(args)  # argparse's own message on a bad flag
    if parsed.config is None:  # with --config the file's values are the run's: flags parsed only
        load_config(args, "finetune-lora", "", validate=False).validate()
    if getattr(parsed, "mesh", None):
        parse_mesh(parsed.mesh, 2**20)  # axis names and sizes (the device count is the run's, not known here)


def check_convert(args: list[str]) -> None:
    from converter.cli import build_parser

    strict(build_parser()).parse_args(args)


def run_main(main, args: list[str], capsys) -> None:
    """`main(args)` until the Stop standing for its real work; ParseError with what it printed if it ends first."""
    try:
        code = main(args)
    except Stop:
        return
    raise ParseError(f"exit {code}: {capsys.readouterr().err.strip()}")


def check_export(args: list[str], monkeypatch, capsys) -> None:
    import export.adapter
    import export.cli

    monkeypatch.setattr(export.cli, "build_parser", lambda real=export.cli.build_parser: strict(real()))
    monkeypatch.setattr(export.adapter, "check_export_targets", _stop)  # the first thing that touches files
    run_main(export.cli.main, args, capsys)


def check_demo(args: list[str], monkeypatch, capsys) -> None:
    import demo.cli

    seen = {}

    def stop(parsed):
        seen["args"] = parsed
        raise Stop

    monkeypatch.setattr(demo.cli, "build_parser", lambda real=demo.cli.build_parser: strict(real()))
    monkeypatch.setattr(demo.cli, "run_demo", stop)
    run_main(demo.cli.main, args, capsys)
    passed = [a for a in seen["args"].finetune_args if a != "--"]
    if passed:  # options after `--` go to finetune-lora, over the demo's own YAML: parsed only
        from finetune.config import build_parser

        strict(build_parser("finetune-lora", "")).parse_args(passed)


def bench_parser(script: str, monkeypatch) -> argparse.ArgumentParser:
    path = ROOT / script
    assert path.is_file(), f"{script} does not exist"
    monkeypatch.syspath_prepend(str(path.parent))  # the scripts import their neighbours by name
    spec = importlib.util.spec_from_file_location(f"_bench_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    assert hasattr(module, "build_parser"), f"{script} has no build_parser() for its options"
    parser = strict(module.build_parser())
    parser.prog = script
    return parser


def test_the_docs_show_commands_of_every_tool():
    """The extraction finds the commands (a change that made it find none would pass every case vacuously)."""
    found = {argv[0] if argv[0] in TOOLS else "bench" for argv in (c.values[0] for c in CASES)}
    assert found == {*TOOLS, "bench"}, found
    assert len(CASES) >= 40, len(CASES)


@pytest.mark.parametrize("argv", CASES)
def test_doc_command_parses(argv, monkeypatch, capsys):
    from jaxmodel.errors import UserError

    command, args = argv[0], argv[1:]
    started = jax_started()
    try:
        if command == "finetune-lora":
            check_finetune(args)
        elif command == "convert-llama":
            check_convert(args)
        elif command == "export-peft":
            check_export(args, monkeypatch, capsys)
        elif command == "llama-jax-demo":
            check_demo(args, monkeypatch, capsys)
        else:
            bench_parser(command, monkeypatch).parse_args(args)
    except (ParseError, UserError) as e:  # UserError: finetune's ConfigFileError, a bad --mesh
        pytest.fail(f"{shlex.join(argv)}\n  {e}", pytrace=False)
    assert started or not jax_started(), "parsing the command started JAX's devices"


def yaml_blocks():
    """(id, text) of the ```yaml fences whose keys are finetune-lora options (a `model:` or `out:` key)."""
    blocks = []
    for path in DOCS:
        lines = path.read_text(encoding="utf-8").split("\n")
        for i, line in enumerate(lines):
            if line.strip() == "```yaml":
                end = next(j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```"))
                text = "\n".join(lines[i + 1:end])
                if re.search(r"^(model|out):", text, re.MULTILINE):
                    blocks.append(pytest.param(text, id=f"{path.relative_to(ROOT)}:{i + 2}"))
    return blocks


@pytest.mark.parametrize("text", yaml_blocks())
def test_docs_yaml_is_a_valid_config(text, tmp_path):
    """A YAML file the docs show for `--config` has only known keys of the right types, and validates."""
    from finetune.config import TrainConfig, read_yaml
    from jaxmodel.errors import UserError

    path = tmp_path / "run.yaml"
    path.write_text(text)
    try:
        TrainConfig(**read_yaml(path)).validate()
    except UserError as e:
        pytest.fail(str(e), pytrace=False)
