"""Run code in a fresh interpreter where some packages behave as if they were not installed."""

import subprocess
import sys


def run_without(modules: tuple[str, ...], code: str) -> subprocess.CompletedProcess:
    """Run `code` where importing any of `modules` fails and `importlib.util.find_spec` does not find them
    (libraries such as transformers probe for torch that way before deciding what to import)."""
    blocker = (
        "import importlib.util, sys\n"
        f"BLOCKED = {modules!r}\n"
        "_find_spec = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda name, package=None: (\n"
        "    None if name.split('.')[0] in BLOCKED else _find_spec(name, package))\n"
        "class NotInstalled:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in BLOCKED:\n"
        "            raise ImportError(f'{name} is not installed here')\n"
        "sys.meta_path.insert(0, NotInstalled())\n"
    )
    return subprocess.run([sys.executable, "-c", blocker + code], capture_output=True, text=True, timeout=300)
