"""Run code in a fresh interpreter where some packages behave as if they were not installed."""

import subprocess
import sys

# The flags the test processes' own backend compiles with (tests/conftest.py), and the processes that compute what
# those are compared with (tests/multihost_worker.py): LLVM's optimisations off, XLA:CPU's loop emitters instead of
# its MLIR fusion emitters; small programs compile in about a third of the time.
QUICK_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"


def quick_compile_env() -> dict[str, str]:
    """This process's environment with QUICK_COMPILE_FLAGS added to XLA_FLAGS: for a subprocess whose programs run
    a step or two, so that compiling them is most of its time, and whose test is not about that compile."""
    import os

    return {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {QUICK_COMPILE_FLAGS}".strip()}


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


def run_multihost_worker(model, out) -> None:
    """Run tests/multihost_worker.py as 2 processes joined over loopback (each with its own simulated devices, so
    without the suite's XLA_FLAGS), on the data files in `out`; fails with a process's stderr if one fails."""
    run_processes("multihost_worker.py", [str(model), str(out)], [])


def run_processes(worker: str, before: list[str], after: list[str], processes: int = 2) -> None:
    """tests/`worker` as `processes` processes, each given `before`, a free loopback port, its process id and
    `after`; fails with a process's stderr if one fails."""
    import os
    import socket
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = Path(__file__).parent / worker
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [subprocess.Popen([sys.executable, str(path), *before, str(port), str(i), *after], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(processes)]
    results = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, err[-3000:]
