"""The preference-objective references (tests/preference_reference.py) agree with each other: the plain torch
implementation of the toolkit's definitions against TRL's own trainers, on a tiny random Llama with a non-zero
LoRA adapter and 4 pairs of different lengths. Plus two facts checkable by hand.

ORPO is where TRL's definition differs: TRL's NLL term is the token-weighted mean over prompt AND completion
tokens of the chosen sequences (all pooled), not the mean over pairs of the chosen completion's per-token mean.
The test checks the parts that agree exactly and pins down the difference (see test_orpo_trl_differs_in_nll_only).
"""

import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("trl")
pytest.importorskip("peft")

from preference_reference import (
    encode_pair,
    lora_parameters,
    torch_reference,
    trl_orpo_nll,
    trl_reference,
)

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Different prompt and completion lengths; completions start with a space and prompts do not end in one, so no
# token spans the boundary and TRL's joint tokenization equals the toolkit's (checked by trl_reference).
PAIRS = [
    {"prompt": "what is the sum of 3 + 4 =", "chosen": " 7", "rejected": " 8 and the fox"},
    {"prompt": "reverse these words: quick brown fox", "chosen": " fox brown quick", "rejected": " quick fox"},
    {"prompt": "user: please add numbers 12 and 30", "chosen": " the answer is 42", "rejected": " 43"},
    {"prompt": "the lazy dog", "chosen": " jumps over the quick brown fox with a lazy dog", "rejected": " is lazy"},
]
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The model is tiny: on shared cores, torch's thread pool costs several times the work (15 s vs 1 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    """demo/tiny.py's byte-level BPE (vocab 300) with BOS added by `tokenizer(text)`, as Llama 3's tokenizer does
    (DPOTrainer takes the prompt's BOS from it)."""
    from transformers import AutoTokenizer

    from demo.tiny import save_tokenizer

    out = tmp_path_factory.mktemp("pref-tok")
    save_tokenizer(out, vocab_size=300)
    return AutoTokenizer.from_pretrained(out, add_bos_token=True)


def _tiny_lora_model(tokenizer, b_std: float):
    """A float32 random Llama (hidden 32, 2 layers) with a LoRA (r=4, all seven projections, no dropout) whose
    lora_B are drawn N(0, b_std^2) from a fixed seed (0: the PEFT init, B = 0)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                         initializer_range=0.2, tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    base = LlamaForCausalLM(config).to(torch.float32).eval()
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=PROJECTIONS, task_type="CAUSAL_LM")
    model = get_peft_model(base, lora)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in lora_parameters(model).items():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * b_std)
    return model


@pytest.fixture(scope="module")
def lora_model(tiny_tokenizer):
    return _tiny_lora_model(tiny_tokenizer, b_std=0.1)


def _rel_grad_error(got: dict, want: dict) -> float:
    assert got.keys() == want.keys()
    diff = math.sqrt(sum(float(((got[k] - want[k]) ** 2).sum()) for k in want))
    norm = math.sqrt(sum(float((want[k] ** 2).sum()) for k in want))
    assert norm > 0
    return diff / norm


def _assert_agree(got, want):
    assert got.loss == pytest.approx(want.loss, rel=LOSS_RTOL)
    assert _rel_grad_error(got.grads, want.grads) <= GRAD_RTOL


@pytest.mark.slow
def test_setup_matches_the_definitions(tiny_tokenizer, lora_model, tmp_path):
    """The fixture is what the definitions assume: `tokenizer(prompt)` is BOS + the prompt's tokens, the pairs
    have different lengths, the gradients are keyed as adapter_model.safetensors is, the LoRA B is non-zero."""
    from safetensors import safe_open

    tok = tiny_tokenizer
    for pair in PAIRS:
        prompt, chosen, rejected = encode_pair(tok, pair)
        assert tok(pair["prompt"])["input_ids"] == prompt and prompt[0] == tok.bos_token_id
        assert chosen[-1] == rejected[-1] == tok.eos_token_id
    encoded = [encode_pair(tok, pair) for pair in PAIRS]
    for lengths in ([len(p) for p, _, _ in encoded], [len(p + c) for p, c, _ in encoded],
                    [len(p + r) for p, _, r in encoded]):
        assert len(set(lengths)) == len(PAIRS), lengths  # every batch row padded differently

    lora_model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "adapter_model.safetensors"), "pt") as f:
        saved = set(f.keys())
    params = lora_parameters(lora_model)
    assert set(params) == saved and len(saved) == 2 * 2 * len(PROJECTIONS)
    assert all(bool(p.abs().gt(0).all()) for p in params.values())
    ref = torch_reference(lora_model, tok, PAIRS, "simpo")
    assert set(ref.grads) == saved


@pytest.mark.slow
@pytest.mark.parametrize("objective, kwargs", [
    ("dpo", {}),
    ("dpo", {"label_smoothing": 0.2}),
    ("dpo", {"beta": 0.5}),
    ("ipo", {}),
    ("simpo", {}),
    ("simpo", {"beta": 2.0, "simpo_gamma": 1.0}),
], ids=["dpo", "dpo-ls0.2", "dpo-beta0.5", "ipo", "simpo", "simpo-b2-g1"])
def test_torch_reference_equals_trl(tiny_tokenizer, lora_model, objective, kwargs):
    want = torch_reference(lora_model, tiny_tokenizer, PAIRS, objective, **kwargs)
    got = trl_reference(lora_model, tiny_tokenizer, PAIRS, objective, **kwargs)
    assert got.stated is None  # TRL's definition is the toolkit's
    _assert_agree(got, want)
    # not a degenerate point: the adapter moves the policy off the reference / the margin off zero
    if objective == "dpo":
        assert float((want.terms["logp_chosen"] - want.terms["ref_chosen"]).abs().min()) > 1e-3


@pytest.mark.slow
def test_dpo_label_smoothing_is_the_stated_mixture(tiny_tokenizer, lora_model):
    """e = 0.2 gives (1-e) L(D) + e L(-D) per pair, not e.g. the robust DPO value (which TRL's "robust" is)."""
    plain = torch_reference(lora_model, tiny_tokenizer, PAIRS, "dpo")
    smooth = torch_reference(lora_model, tiny_tokenizer, PAIRS, "dpo", label_smoothing=0.2)
    flipped = torch.nn.functional.softplus(0.1 * (plain.terms["logp_chosen"] - plain.terms["ref_chosen"]
                                                  - plain.terms["logp_rejected"] + plain.terms["ref_rejected"]))
    want = (0.8 * plain.terms["loss"] + 0.2 * flipped).mean()
    assert smooth.loss == pytest.approx(float(want), rel=1e-6)


@pytest.mark.slow
def test_orpo_trl_differs_in_nll_only(tiny_tokenizer, lora_model):
    """ORPO: TRL's odds-ratio term is the definition; its NLL is not. The definition computed from TRL's own pieces
    (`.stated`) equals the torch reference; TRL's loss exceeds it by exactly NLL_trl - mean(-a_c), where NLL_trl
    pools every chosen-sequence token after BOS, prompt included, over the batch (`trl_orpo_nll`)."""
    want = torch_reference(lora_model, tiny_tokenizer, PAIRS, "orpo")
    got = trl_reference(lora_model, tiny_tokenizer, PAIRS, "orpo")
    assert got.stated is not None
    _assert_agree(got.stated, want)

    nll_stated = float((-want.terms["logp_chosen"] / want.terms["n_chosen"]).mean())
    nll_trl = trl_orpo_nll(lora_model, tiny_tokenizer, PAIRS)
    assert got.loss - got.stated.loss == pytest.approx(nll_trl - nll_stated, rel=1e-4, abs=1e-5)
    # the difference is real on these pairs (prompts are scored, pairs are weighted by their token counts)
    assert abs(nll_trl - nll_stated) > 1e-2
    assert _rel_grad_error(got.grads, want.grads) > 1e-2

    # the same with a larger lambda: only the odds-ratio term changes, and it still agrees
    want5 = torch_reference(lora_model, tiny_tokenizer, PAIRS, "orpo", orpo_lambda=5.0)
    got5 = trl_reference(lora_model, tiny_tokenizer, PAIRS, "orpo", orpo_lambda=5.0)
    _assert_agree(got5.stated, want5)
    assert got5.loss - got5.stated.loss == pytest.approx(nll_trl - nll_stated, rel=1e-4, abs=1e-5)


@pytest.mark.slow
def test_dpo_with_zero_lora_b_is_ln2_with_zero_lora_a_grads(tiny_tokenizer):
    """Every lora_B zero: the policy is the reference, so D = 0 exactly and the loss is -log s(0) = ln 2 for any
    beta; d loss / d A passes through B, so every lora_A gradient is exactly zero (lora_B's are not)."""
    model = _tiny_lora_model(tiny_tokenizer, b_std=0.0)
    for beta in (0.1, 1.0):
        ref = torch_reference(model, tiny_tokenizer, PAIRS, "dpo", beta=beta)
        assert torch.equal(ref.terms["logp_chosen"], ref.terms["ref_chosen"])
        assert torch.equal(ref.terms["logp_rejected"], ref.terms["ref_rejected"])
        assert ref.loss == float(torch.tensor(math.log(2), dtype=torch.float32))
        assert ref.loss == pytest.approx(math.log(2), rel=1e-7)
        a_grads = {k: g for k, g in ref.grads.items() if "lora_A" in k}
        b_grads = {k: g for k, g in ref.grads.items() if "lora_B" in k}
        assert len(a_grads) == len(b_grads) == 2 * len(PROJECTIONS)
        assert all(int(torch.count_nonzero(g)) == 0 for g in a_grads.values())
        assert sum(float(g.abs().sum()) for g in b_grads.values()) > 0


# ---- the toolkit against TRL ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def toolkit_inputs(tiny_tokenizer, lora_model, tmp_path_factory):
    """The same model converted for JAX, its adapter as a PEFT directory (for --init-adapter) and PAIRS as a file."""
    import json

    from converter.conversion import convert

    root = tmp_path_factory.mktemp("pref-toolkit")
    import copy

    copy.deepcopy(lora_model).unload().save_pretrained(root / "hf")  # the base model, without the LoRA modules
    tiny_tokenizer.save_pretrained(root / "hf")
    convert(root / "hf", root / "jax", progress=False)
    lora_model.save_pretrained(root / "adapter")
    (root / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    return root


def toolkit_step1(root, objective: str, **kwargs):
    """(step-1 loss, LoRA gradients by PEFT name) of `finetune-lora --objective ... --init-adapter ADAPTER`, every
    pair in one step on one device, float32."""
    import jax

    from finetune.config import TrainConfig
    from finetune.step.preference import Objective
    from finetune.step.train_step import preference_loss_and_grads
    from finetune.train.batches import pair_batch
    from finetune.train.build import setup
    from jaxmodel.formats.peft_adapter import peft_tensors

    reference = {"reference": "base"} if objective in ("dpo", "ipo") else {}
    config = TrainConfig(model=str(root / "jax"), data=str(root / "pairs.jsonl"), out=str(root / "run"),
                         objective=objective, init_adapter=str(root / "adapter"), batch_size=len(PAIRS), seq_len=64,
                         dtype="float32", pack=False, mesh="dp=1,fsdp=1,mp=1", progress=False, **reference,
                         **kwargs).validate()
    run = setup(config, devices=jax.devices()[:1])
    base, ref = run.frozen
    with jax.set_mesh(run.mesh):
        loss, metrics, grads = jax.jit(lambda lora, base, batch: preference_loss_and_grads(
            run.graphdef, lora, base, ref, batch, Objective.of(config), config.batch_size))(
            run.state.lora, base, pair_batch(run.train_rows, run.batch_sharding, 0))
    assert float(metrics["pairs"]) == len(PAIRS)
    return float(loss), {k: torch.from_numpy(v) for k, v in peft_tensors(jax.device_get(grads), run.llama).items()}


@pytest.mark.slow
@pytest.mark.parametrize("objective, kwargs", [
    ("dpo", {}),
    ("dpo", {"label_smoothing": 0.2}),
    ("ipo", {}),
    ("simpo", {}),
    ("orpo", {}),
], ids=["dpo", "dpo-ls0.2", "ipo", "simpo", "orpo"])
def test_the_toolkit_equals_trl(tiny_tokenizer, lora_model, toolkit_inputs, objective, kwargs):
    """TRL on the same Llama, adapter and pairs gives the step-1 loss and LoRA gradients the toolkit computes
    (for ORPO, TRL's pieces with the stated NLL: see test_orpo_trl_differs_in_nll_only)."""
    loss, grads = toolkit_step1(toolkit_inputs, objective, **kwargs)
    trl = trl_reference(lora_model, tiny_tokenizer, PAIRS, objective, **kwargs)
    want = trl.stated if objective == "orpo" else trl
    assert loss == pytest.approx(want.loss, rel=LOSS_RTOL)
    assert _rel_grad_error(grads, want.grads) <= GRAD_RTOL
