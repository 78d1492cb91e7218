"""A pytest plugin recording where each test's time goes, for tests/durations.py: its wall time (setup, call and
teardown), the part of it this process spent tracing, lowering and compiling JAX programs (compiles answered from
the persistent compilation cache included), and the CPU time of the processes it started and waited for (the CLIs'
runs, the multi-process workers). conftest.py registers it when LLAMA_JAX_TEST_TIMES names a directory; each process
appends one JSON line a test to a file of its own there."""

import json
import os
import resource
import time

import pytest

# The events JAX records around each compile (jax._src.dispatch): tracing to a jaxpr, lowering it to StableHLO, and
# the backend's compile or the persistent cache's answer.
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")


# The names the records give each event's seconds.
PARTS = dict(zip(COMPILE_EVENTS, ("trace_s", "lower_s", "backend_s")))


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class Recorder:
    def __init__(self, directory: str):
        self.path = os.path.join(directory, f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-{os.getpid()}.jsonl")
        self.seconds = dict.fromkeys(PARTS.values(), 0.0)  # this process's compile events so far, by part
        import jax.monitoring

        jax.monitoring.register_event_duration_secs_listener(self._on_duration)

    def _on_duration(self, event: str, duration: float, **_) -> None:
        if event in PARTS:
            self.seconds[PARTS[event]] += duration

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        before, start, children_before = dict(self.seconds), time.perf_counter(), _children_cpu_s()
        yield
        parts = {name: self.seconds[name] - before[name] for name in self.seconds}
        record = {"test": item.nodeid, "wall_s": time.perf_counter() - start, "compile_s": sum(parts.values()),
                  **parts, "children_cpu_s": _children_cpu_s() - children_before}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def register(config) -> None:
    """The recorder registered with pytest where LLAMA_JAX_TEST_TIMES names a directory."""
    directory = os.environ.get("LLAMA_JAX_TEST_TIMES")
    if directory:
        os.makedirs(directory, exist_ok=True)
        config.pluginmanager.register(Recorder(directory), "llama-jax-test-times")
