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


class Recorder:
    def __init__(self, directory: str):
        self.path = os.path.join(directory, f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-{os.getpid()}.jsonl")
        self.compile_s = 0.0
        self.by_event = dict.fromkeys(COMPILE_EVENTS, 0.0)
        import jax.monitoring

        jax.monitoring.register_event_duration_secs_listener(self._on_duration)

    def _on_duration(self, event: str, duration: float, **_) -> None:
        if event in COMPILE_EVENTS:
            self.compile_s += duration
            self.by_event[event] += duration

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        compile_before, start = self.compile_s, time.perf_counter()
        events_before = dict(self.by_event)
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        children_before = children.ru_utime + children.ru_stime
        yield
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        record = {"test": item.nodeid, "wall_s": time.perf_counter() - start,
                  "compile_s": self.compile_s - compile_before,
                  "trace_s": self.by_event[COMPILE_EVENTS[0]] - events_before[COMPILE_EVENTS[0]],
                  "lower_s": self.by_event[COMPILE_EVENTS[1]] - events_before[COMPILE_EVENTS[1]],
                  "backend_s": self.by_event[COMPILE_EVENTS[2]] - events_before[COMPILE_EVENTS[2]],
                  "children_cpu_s": children.ru_utime + children.ru_stime - children_before}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def register(config) -> None:
    """The recorder registered with pytest where LLAMA_JAX_TEST_TIMES names a directory."""
    directory = os.environ.get("LLAMA_JAX_TEST_TIMES")
    if directory:
        os.makedirs(directory, exist_ok=True)
        config.pluginmanager.register(Recorder(directory), "llama-jax-test-times")
