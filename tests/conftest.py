"""Test setup: 8 simulated CPU devices, an offline hub, shared fixtures."""

import atexit
import json
import os
import shutil
import tempfile

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


def _start_jax_with_llvm_unoptimised() -> None:
    """This process's own programs are small and compiled once or twice each: compiling them takes longer than running
    them, and without LLVM's optimisations XLA:CPU compiles them in about half the time. The HLO, its partitioning,
    memory and collectives are XLA's and the same; elementwise functions such as exp are computed by other code and
    may differ in their last bits (exp by up to ~5e-7 relative), well inside the suite's float32 bounds, and the
    paths a test compares with each other run alike. XLA reads XLA_FLAGS once, when the backend starts: it starts
    here with the flag, and the environment is then set back, so that subprocesses (the CLIs' runs, the demo, whose
    programs run long enough to repay LLVM's work) compile as a user's run does."""
    flags = os.environ["XLA_FLAGS"]
    if "--xla_backend_optimization_level" in flags:
        return
    os.environ["XLA_FLAGS"] = f"{flags} --xla_backend_optimization_level=0"
    try:
        import jax

        jax.devices()
    finally:
        os.environ["XLA_FLAGS"] = flags


_start_jax_with_llvm_unoptimised()

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

_common = dict(deadline=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("dev", **_common)
# CI draws the same examples every run, so a red CI always means a change, never a new draw;
# local runs (the dev profile) keep exploring.
settings.register_profile("ci", derandomize=True, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A small HF Llama directory (sharded safetensors, tokenizer) built once per session."""
    from demo.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("hf") / "tiny", max_shard_size=200_000)


@pytest.fixture(scope="session")
def tiny_converted(tiny_checkpoint, tmp_path_factory):
    """`tiny_checkpoint` converted once per session (read-only for tests)."""
    from converter import convert

    out = tmp_path_factory.mktemp("jax") / "tiny"
    convert(tiny_checkpoint, out, progress=False)
    return out


def _pretrained(name: str, build):
    """`build()` (a tests/pretrained.py checkpoint), or the test skipped with the reason it cannot be had."""
    import pretrained

    try:
        return build()
    except pretrained.Unavailable as e:
        pytest.skip(f"{name} unavailable: {e}")


def _converted(checkpoint, tmp_path_factory, name: str):
    from converter import convert

    out = tmp_path_factory.mktemp("jax") / name
    convert(checkpoint, out, progress=False)
    return out


@pytest.fixture(scope="session")
def smollm2_checkpoint():
    """SmolLM2-135M-Instruct as an HF checkpoint directory (tests/pretrained.py), read-only; skipped with the reason
    when it cannot be had."""
    import pretrained

    return _pretrained("SmolLM2-135M-Instruct", pretrained.smollm2_checkpoint)


@pytest.fixture(scope="session")
def smollm2_converted(smollm2_checkpoint, tmp_path_factory):
    """`smollm2_checkpoint` converted once per session (read-only for tests)."""
    return _converted(smollm2_checkpoint, tmp_path_factory, "smollm2")


@pytest.fixture(scope="session")
def gemma3_checkpoint():
    """Gemma 3 270M as an HF checkpoint directory (tests/pretrained.py), read-only; skipped with the reason when it
    cannot be had."""
    import pretrained

    return _pretrained("Gemma 3 270M", pretrained.gemma3_checkpoint)


@pytest.fixture(scope="session")
def gemma3_converted(gemma3_checkpoint, tmp_path_factory):
    """`gemma3_checkpoint` converted once per session (read-only for tests)."""
    return _converted(gemma3_checkpoint, tmp_path_factory, "gemma3")


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
    """The lines of a tool's stderr, less `finetune-lora`'s data summary (printed by every run that loads data)."""
    return [line for line in text.strip().splitlines() if not line.startswith("finetune-lora: data: ")]
