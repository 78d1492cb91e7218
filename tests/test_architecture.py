"""The packages' import directions, no import cycle between modules, the public API, the map in docs/design.md,
and lazy imports that leave `--plan` its devices."""

import ast
import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest
from isolation import run_without

ROOT = Path(__file__).parent.parent
# Each package, and the packages it must never import: jaxmodel (the model and the shared formats) is at the
# bottom; converter and finetune stand on it alone; export reads runs through finetune; demo may use all.
FORBIDDEN = {
    "jaxmodel": ("converter", "finetune", "export", "demo"),
    "converter": ("finetune", "export", "demo"),
    "finetune": ("converter", "export", "demo"),
    "export": ("converter", "demo"),
}


# finetune's subpackages and the others each may import (directly; config is at the bottom of all). data imports
# no JAX so tokenizer workers start light; planning never imports data (a plan needs none); run stands below
# train so that export-peft reads runs without the training or data code.
SUBPACKAGES = {
    "finetune.config": (),
    "finetune.config_doc": ("finetune.config",),
    "finetune.data": ("finetune.config",),
    "finetune.step": ("finetune.config",),
    "finetune.run": ("finetune.config", "finetune.step"),
    "finetune.planning": ("finetune.config", "finetune.step"),
    "finetune.rollout": ("finetune.config", "finetune.step"),
    "finetune.train": ("finetune.config", "finetune.data", "finetune.step", "finetune.run", "finetune.rollout"),
    "finetune.cli": ("finetune.config", "finetune.planning", "finetune.train"),
}
PACKAGES = ("jaxmodel", "converter", "finetune", "export", "demo")


def modules_of(package: str) -> list[str]:
    found = [package]
    for info in pkgutil.walk_packages([str(ROOT / package)], prefix=package + "."):
        found.append(info.name)
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
@pytest.mark.slow
def test_every_module_imports_with_the_packages_it_must_not_use_blocked(package):
    modules = modules_of(package)
    assert len(modules) > 2
    result = run_without(FORBIDDEN[package], "import importlib\n" + "".join(
        f"importlib.import_module({name!r})\n" for name in modules))
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.slow
def test_the_blocking_is_real():
    result = run_without(("finetune",), "import export.adapter")
    assert result.returncode != 0 and "finetune" in result.stderr


def test_public_api():
    from export import export_adapter, export_merged, save_merged  # noqa: F401
    from finetune import TrainConfig, load_run, plan, run_training  # noqa: F401
    from jaxmodel import ModelConfig, CausalLM, LoraConfig, apply_lora, generate, load_pretrained  # noqa: F401
    from jaxmodel.errors import UsageError, UserError

    import finetune.train.loop

    assert callable(finetune.train.loop.run_training) and finetune.run_training is finetune.train.loop.run_training
    assert issubclass(UsageError, UserError)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        import jaxmodel

        jaxmodel.nope


def test_public_names_stay_functions_after_every_module_is_imported():
    """A submodule named like a public function would replace it on the package once imported."""
    import importlib
    import types

    for package in ("jaxmodel", "converter", "finetune", "export"):
        for name in modules_of(package):
            importlib.import_module(name)
        module = importlib.import_module(package)
        for public in module.__all__:
            assert not isinstance(getattr(module, public), types.ModuleType), f"{package}.{public}"


@pytest.mark.slow
def test_importing_a_package_does_not_import_jax():
    result = run_without((), "import sys\nimport converter, demo, export, finetune, jaxmodel\n"
                             "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if 'jax' in m)")
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.slow
def test_the_model_imports_pallas_only_for_a_pallas_kernel():
    """Pallas' Triton modules (a tenth of a second) load at a Pallas kernel's first call, not with the model."""
    result = run_without((), "import sys\nimport jaxmodel.attention, jaxmodel.model\n"
                             "assert 'jax.experimental.pallas' not in sys.modules, 'pallas was imported'")
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.slow
def test_plan_simulates_its_devices_after_the_public_api_was_imported(tmp_path):
    config = {"model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "torch_dtype": "float32"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    code = (
        "import sys\n"
        "import converter, export, finetune, jaxmodel\n"
        "from finetune import TrainConfig, plan, run_training\n"
        "from jaxmodel import LoraConfig, generate, load_pretrained\n"
        "from finetune.cli import main\n"
        f"code = main(['--plan', '--model-config', {str(tmp_path / 'config.json')!r}, '--mesh', 'dp=1,fsdp=4,mp=1',\n"
        "             '--batch-size', '4', '--seq-len', '16', '--hbm-gb', '1'])\n"
        "import jax\n"
        "print('devices', jax.device_count())\n"
        "sys.exit(code)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "mesh dp=1,fsdp=4,cp=1,mp=1" in result.stdout and "devices 4" in result.stdout


def module_files() -> dict[str, Path]:
    """Every module of the toolkit's packages by dotted name (a package by its name, from its __init__.py)."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported_modules(name: str, path: Path, known) -> set[str]:
    """The modules `name` imports, anywhere in it (inside functions too: a lazy import still makes a cycle), as the
    longest dotted names that are modules of `known`, or the top-level name of anything else (`jax`, `numpy`)."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            parts = target.split(".")
            while len(parts) > 1 and ".".join(parts) not in known:
                parts.pop()
            found.add(".".join(parts))
    found.discard(name)
    return found


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: imported_modules(name, path, files) for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle among the modules of `graph` (as a path that returns to its start), or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in graph:
                continue
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [m for m in graph if m == start or m.startswith(start + ".")]
    while todo:
        node = todo.pop()
        if node not in seen and node in graph:
            seen.add(node)
            todo.extend(graph[node])
    return seen


def subpackage(module: str) -> str | None:
    return next((p for p in SUBPACKAGES if module == p or module.startswith(p + ".")), None)


def test_no_import_cycle_between_modules():
    assert find_cycle(import_graph()) is None, " -> ".join(find_cycle(import_graph()))


def test_the_cycle_check_sees_imports_inside_functions(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "a.py").write_text("import pkg.b\n")
    (package / "b.py").write_text("def f():\n    from pkg import a  # lazy\n    return a\n")
    known = {"pkg", "pkg.a", "pkg.b"}
    graph = {name: imported_modules(name, package / f"{name.split('.')[-1]}.py", known) for name in ("pkg.a", "pkg.b")}
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.a"]


def test_finetune_subpackages_import_only_downwards():
    graph = import_graph()
    modules = [m for m in graph if m.startswith("finetune.")]
    assert {subpackage(m) for m in modules} == set(SUBPACKAGES), "a module of finetune outside every subpackage"
    wrong = sorted(f"{m} imports {d}" for m in modules for d in graph[m]
                   if d.startswith("finetune.") and subpackage(d) not in (subpackage(m), *SUBPACKAGES[subpackage(m)]))
    assert not wrong, wrong


@pytest.mark.slow
def test_data_code_never_imports_jax():
    """Not even inside a function (the static check), and importing every data module loads none of the JAX stack
    (a fresh interpreter where it is not installed)."""
    graph = import_graph()
    jax_stack = ("jax", "jaxlib", "flax", "optax", "orbax")
    wrong = sorted(f"{m} imports {d}" for m in graph if m.startswith("finetune.data") for d in graph[m]
                   if d.split(".")[0] in jax_stack)
    assert not wrong, wrong
    modules = sorted(m for m in module_files() if m.startswith("finetune.data."))
    result = run_without(jax_stack, "import importlib\n" + "".join(
        f"importlib.import_module({name!r})\n" for name in modules))
    assert result.returncode == 0, result.stderr[-3000:]


def test_planning_never_reaches_data_code_and_export_reaches_only_runs():
    graph = import_graph()
    assert not {m for m in reachable(graph, "finetune.planning") if m.startswith("finetune.data")}
    from_export = {m for m in reachable(graph, "export") if m.startswith("finetune.")}
    assert from_export and {subpackage(m) for m in from_export} <= {"finetune.run", "finetune.step", "finetune.config"}


def test_every_module_is_on_the_map_in_design_md():
    """docs/design.md names each module by its path within its package (`data/workers.py`, `formats/hf_names.py`)."""
    design = (ROOT / "docs" / "design.md").read_text()
    missing = [str(path.relative_to(ROOT)) for path in module_files().values() if path.name != "__init__.py"
               and f"`{path.relative_to(ROOT / path.relative_to(ROOT).parts[0]).as_posix()}`" not in design]
    assert not missing, f"modules not named in docs/design.md: {missing}"
