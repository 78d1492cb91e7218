"""Test setup: 8 simulated CPU devices, an offline hub, shared fixtures."""

import atexit
import json
import os
import shutil
import tempfile
from pathlib import Path

# Before jax is imported anywhere: a simulated 8-device node, and no network for the hub. On two busy cores the
# simulated devices' threads can reach one collective more than XLA's default 40 s apart, which aborts the process:
# the limit is raised (a collective that truly hangs still ends, after 10 minutes).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 "
                                   "--xla_cpu_collective_call_terminate_timeout_seconds=600")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The one cache kept across test sessions (tests/pretrained.py's downloaded checkpoint), taken from the user's cache
# before the tools' caches are pointed at this session's directory below.
os.environ.setdefault("LLAMA_JAX_TEST_CACHE", os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "llama-jax-tests"))
# Caches the tools write (tokenized data, datasets' Arrow copies) go to a directory of this test session,
# never the user's: tests and their subprocesses start from empty caches.
_CACHE = tempfile.mkdtemp(prefix="llama-jax-tests-")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
os.environ["XDG_CACHE_HOME"] = _CACHE
os.environ["HF_HOME"] = os.path.join(_CACHE, "huggingface")
# JAX's persistent compilation cache in this session's directory (unless the environment names one): the many
# runs of the same small models in tests and their subprocesses (finetune-lora, export-peft, the multi-process
# runs) compile each program once (the suite's time with and without it: README). Set before pytest-xdist starts
# its workers, so they and their subprocesses share the controller's directory.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(_CACHE, "jax-compilation"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# What `built_once` builds: the controller's directory too, so that every worker reads one copy.
os.environ.setdefault("LLAMA_JAX_TEST_SHARED", os.path.join(_CACHE, "shared"))


def _start_jax_compiling_quickly() -> None:
    """This process's own programs are small and compiled once or twice each: compiling them takes longer than running
    them. Without LLVM's optimisations and with XLA:CPU's older loop emitters in place of its MLIR fusion emitters,
    they compile in about a third of the time (the suite's durations table: docs/design.md). The HLO, its
    partitioning, memory and collectives are XLA's and the same; elementwise functions such as exp are computed by
    other code and may differ in their last bits (exp by up to ~5e-7 relative), well inside the suite's float32
    bounds, and the paths a test compares with each other run alike. XLA reads XLA_FLAGS once, when the backend
    starts: it starts here with the flags, and the environment is then set back, so that subprocesses (the CLIs'
    runs, the demo, whose programs run long enough to repay LLVM's work) compile as a user's run does."""
    flags = os.environ["XLA_FLAGS"]
    if "--xla_backend_optimization_level" in flags:
        return
    from isolation import QUICK_COMPILE_FLAGS

    os.environ["XLA_FLAGS"] = f"{flags} {QUICK_COMPILE_FLAGS}"
    try:
        import jax

        jax.devices()
    finally:
        os.environ["XLA_FLAGS"] = flags


_start_jax_compiling_quickly()

import subprocess  # noqa: E402

import jax.monitoring  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

_common = dict(deadline=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("dev", **_common)
# CI draws the same examples every run, so a red CI always means a change, never a new draw;
# local runs (the dev profile) keep exploring.
settings.register_profile("ci", derandomize=True, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


def pytest_configure(config):
    import timing

    timing.register(config)


# The fast tier (`tox -e fast`: tests marked neither slow nor e2e) stays fast by what its tests do, not by a timer: a
# test of it that starts a Python process or compiles a train step (in its fixtures too) fails, naming what it did.
# `_FAST_TIER["test"]` is the fast-tier test being run, `found` what it did that the tier does not allow.
_FAST_TIER = {"test": None, "found": []}
_execute_child = subprocess.Popen._execute_child


def _execute_child_noted(self, args, *rest, **kwargs):
    program = str(args if isinstance(args, (str, bytes, os.PathLike)) else args[0])
    if _FAST_TIER["test"] is not None and "python" in os.path.basename(program):  # not `true`, `sleep` or `bash -n`
        _FAST_TIER["found"].append(f"started a Python process ({program})")
    return _execute_child(self, args, *rest, **kwargs)


subprocess.Popen._execute_child = _execute_child_noted


TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"  # jax._src.dispatch.JAXPR_TRACE_EVENT


def _on_trace(event: str, duration: float, fun_name: str = "", **_) -> None:
    if _FAST_TIER["test"] is not None and event == TRACE_EVENT and fun_name == "train_step":
        _FAST_TIER["found"].append("compiled a train step")


jax.monitoring.register_event_duration_secs_listener(_on_trace)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    fast = not (item.get_closest_marker("slow") or item.get_closest_marker("e2e"))
    _FAST_TIER.update(test=item.nodeid if fast else None, found=[])
    yield
    _FAST_TIER["test"] = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if call.when == "call" and report.passed and _FAST_TIER["found"]:
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} is in the fast tier (marked neither slow nor e2e) but "
                           f"{'; '.join(dict.fromkeys(_FAST_TIER['found']))}: mark it slow")


def built_once(name: str, build) -> Path:
    """`build(path)` run once a test session, by whichever process asks first (an xdist worker, or pytest alone), into
    a directory the session's workers share; the others wait on its lock and get what it built. Returns the path
    (read-only for tests)."""
    from filelock import FileLock

    root = Path(os.environ["LLAMA_JAX_TEST_SHARED"])
    root.mkdir(parents=True, exist_ok=True)
    path = root / name
    with FileLock(root / f"{name}.lock"):
        if not path.exists():
            partial = root / f"{name}.partial"
            shutil.rmtree(partial, ignore_errors=True)
            build(partial)
            partial.rename(path)
    return path


def _convert(checkpoint: Path):
    from converter import convert

    return lambda out: convert(checkpoint, out, progress=False)


@pytest.fixture(scope="session")
def tiny_checkpoint():
    """A small HF Llama directory (sharded safetensors, tokenizer) built once a session."""
    from demo.tiny import build_tiny_model

    return built_once("hf-tiny", lambda out: build_tiny_model(out, max_shard_size=200_000))


@pytest.fixture(scope="session")
def tiny_converted(tiny_checkpoint):
    """`tiny_checkpoint` converted once a session (read-only for tests)."""
    return built_once("jax-tiny", _convert(tiny_checkpoint))


def _pretrained(name: str, build):
    """`build()` (a tests/pretrained.py checkpoint), or the test skipped with the reason it cannot be had."""
    import pretrained

    try:
        return build()
    except pretrained.Unavailable as e:
        pytest.skip(f"{name} unavailable: {e}")


@pytest.fixture(scope="session")
def smollm2_checkpoint():
    """SmolLM2-135M-Instruct as an HF checkpoint directory (tests/pretrained.py), read-only; skipped with the reason
    when it cannot be had."""
    import pretrained

    return _pretrained("SmolLM2-135M-Instruct", pretrained.smollm2_checkpoint)


@pytest.fixture(scope="session")
def smollm2_converted(smollm2_checkpoint):
    """`smollm2_checkpoint` converted once a session (read-only for tests)."""
    return built_once("jax-smollm2", _convert(smollm2_checkpoint))


@pytest.fixture(scope="session")
def gemma3_checkpoint():
    """Gemma 3 270M as an HF checkpoint directory (tests/pretrained.py), read-only; skipped with the reason when it
    cannot be had."""
    import pretrained

    return _pretrained("Gemma 3 270M", pretrained.gemma3_checkpoint)


@pytest.fixture(scope="session")
def gemma3_converted(gemma3_checkpoint):
    """`gemma3_checkpoint` converted once a session (read-only for tests)."""
    return built_once("jax-gemma3", _convert(gemma3_checkpoint))


@pytest.fixture(scope="session")
def two_process_grads(tiny_converted):
    """The directory of tests/multihost_worker.py's results: <case>.npz for each of its CASES, and the data files
    they were computed on (each the same bytes as its test module's data file), from one pair of processes a
    session."""
    from isolation import run_multihost_worker
    from test_context_parallel import write_packed_data
    from test_finetune import addition_rows
    from test_preference_training import addition_pairs
    from rl_cases import prompt_rows, write_rewards

    def build(out):
        from tiny_moe import TINY_DEEPSEEK, TINY_MOE

        from converter import convert
        from demo.tiny import build_tiny_model

        out.mkdir()
        write_jsonl(out / "sft.jsonl", addition_rows())
        write_packed_data(out / "packed.jsonl")
        write_jsonl(out / "pairs.jsonl", addition_pairs())
        write_jsonl(out / "prompts.jsonl", prompt_rows())
        write_rewards(out)
        convert(build_tiny_model(out / "moe-hf", TINY_MOE), out / "moe", progress=False)
        convert(build_tiny_model(out / "deepseek-hf", TINY_DEEPSEEK), out / "deepseek", progress=False)
        run_multihost_worker(tiny_converted, out)

    return built_once("two-process-grads", build)


@pytest.fixture(scope="module")
def tokenizer(tiny_converted):
    """The tiny checkpoint's tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_converted)


@pytest.fixture
def default_allocator(monkeypatch):
    """None of JAX's allocator variables set: plans judged against the default usable memory."""
    from finetune.planning import allocator

    for name in (allocator.FRACTION, allocator.FRACTION_DEPRECATED, allocator.PREALLOCATE, allocator.ALLOCATOR):
        monkeypatch.delenv(name, raising=False)


def write_jsonl(path, rows):
    """`rows` (dicts, or raw lines as strings) as a JSONL file at `path`; returns `path`."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def run_model(run_dir, converted_dir):
    """The converted model with the LoRA adapters of a run's newest checkpoint."""
    from flax import nnx

    from finetune.run.reading import load_run
    from jaxmodel import apply_lora, load_pretrained

    lora, config, _ = load_run(run_dir)
    model = load_pretrained(converted_dir)
    apply_lora(model, config.lora_config(), rngs=nnx.Rngs(0))
    nnx.update(model, lora)
    return model


def stderr_lines(text: str) -> list[str]:
    """The lines of a tool's stderr, less `finetune-lora`'s data summary and adapter line (printed by every run that
    loads data and a model)."""
    return [line for line in text.strip().splitlines()
            if not line.startswith(("finetune-lora: data: ", "finetune-lora: adapter: "))]
