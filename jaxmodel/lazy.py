"""Package attributes imported on first use, so that importing a package does not import JAX.

`finetune-lora --plan` must set `XLA_FLAGS` (simulated devices) before JAX starts; a public API that
imported JAX eagerly would make `import finetune` too early for that.
"""

from __future__ import annotations

import importlib
from typing import Callable, Mapping


def lazy_exports(package: str, exports: Mapping[str, str]) -> tuple[Callable, Callable]:
    """`(__getattr__, __dir__)` for `package` whose public names live in the modules `exports` maps them to
    (`"module"`, or `"module:name"` where the name differs there)."""

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, _, attribute = exports[name].partition(":")
        return getattr(importlib.import_module(module), attribute or name)

    def __dir__() -> list[str]:
        return sorted(exports)

    return __getattr__, __dir__
