"""The packages' import directions, the public API, and lazy imports that leave `--plan` its devices."""

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


def modules_of(package: str) -> list[str]:
    found = [package]
    for info in pkgutil.walk_packages([str(ROOT / package)], prefix=package + "."):
        found.append(info.name)
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_every_module_imports_with_the_packages_it_must_not_use_blocked(package):
    modules = modules_of(package)
    assert len(modules) > 2
    result = run_without(FORBIDDEN[package], "import importlib\n" + "".join(
        f"importlib.import_module({name!r})\n" for name in modules))
    assert result.returncode == 0, result.stderr[-3000:]


def test_the_blocking_is_real():
    result = run_without(("finetune",), "import export.adapter")
    assert result.returncode != 0 and "finetune" in result.stderr


def test_public_api():
    from export import export_adapter, export_merged, save_merged  # noqa: F401
    from finetune import TrainConfig, load_run, plan, run_training  # noqa: F401
    from jaxmodel import LlamaConfig, LlamaForCausalLM, LoraConfig, apply_lora, generate, load_pretrained  # noqa: F401
    from jaxmodel.errors import UsageError, UserError

    import finetune.train

    assert callable(finetune.train.run_training) and finetune.run_training is finetune.train.run_training
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


def test_importing_a_package_does_not_import_jax():
    result = run_without((), "import sys\nimport converter, demo, export, finetune, jaxmodel\n"
                             "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if 'jax' in m)")
    assert result.returncode == 0, result.stderr[-3000:]


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
