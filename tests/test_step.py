"""What a train step computes, against independent references: the loss is the token-level cross-entropy
over exactly the promised targets, masked targets have no effect, the learning rate follows the schedule
written out by hand, and clipping hands AdamW a gradient of global norm `clip_norm`."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from transformers import AutoTokenizer

from finetune.config import TrainConfig, load_config
from finetune.data.reference import build_rows, tokenize
from finetune.step.train_step import TrainState, build_steps, loss_and_grads, make_optimizer, split_model
from jaxmodel import ModelConfig, CausalLM, load_pretrained
from jaxmodel.lora import ALL_TARGETS, LoraConfig, apply_lora, target_linears

ASSISTANT_HEADER = "<|start_header_id|>assistant<|end_header_id|>\n\n"
EOT = "<|eot_id|>"
TEXT = "the quick brown fox jumps over the lazy dog"
PROMPT, COMPLETION = "add 12 + 7 =", " 19"
MESSAGES = [{"role": "system", "content": "answer the question"}, {"role": "user", "content": "reverse: fox dog"},
            {"role": "assistant", "content": "dog fox"}, {"role": "user", "content": "again please"},
            {"role": "assistant", "content": "fox dog"}]
ROWS = [("text", {"text": TEXT}), ("prompt", {"prompt": PROMPT, "completion": COMPLETION}),
        ("chat", {"messages": MESSAGES})]
SEQ_LEN = 64
PAD = 5  # the tiny tokenizer's <|pad|>


@pytest.fixture(scope="module")
def tokenizer(tiny_converted):
    return AutoTokenizer.from_pretrained(tiny_converted)


@pytest.fixture(scope="module")
def model(tiny_converted):
    """The tiny model with adapters whose B is non-zero, so that every LoRA matrix gets a gradient."""
    model = apply_lora(load_pretrained(tiny_converted), LoraConfig(rank=4, alpha=8), rngs=nnx.Rngs(1))
    for i, (_, linear) in enumerate(target_linears(model, ALL_TARGETS)):
        linear.lora_b.set_value(0.05 * jax.random.normal(jax.random.key(i), linear.lora_b[...].shape))
    return model


# ---- independent references ------------------------------------------------------------------------


def expected_documents(tokenizer) -> list[tuple[list[int], list[int]]]:
    """(token ids, positions whose token is a training target) per row, derived from the row formats'
    definitions and the token ids alone: text: every token after BOS (EOS included); prompt/completion:
    the completion's tokens and EOS; chat: each assistant turn's content tokens and its end-of-turn token."""
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)


    text_ids = [bos] + encode(TEXT) + [eos]
    text_targets = list(range(1, len(text_ids)))

    prompt_ids, completion_ids = [bos] + encode(PROMPT), encode(COMPLETION) + [eos]
    pc_ids = prompt_ids + completion_ids
    pc_targets = list(range(len(prompt_ids), len(pc_ids)))

    rendered = tokenizer.apply_chat_template(MESSAGES, tokenize=True)
    chat_ids = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    header, (eot,) = encode(ASSISTANT_HEADER), encode(EOT)
    chat_targets, turns = [], []
    for start in range(len(chat_ids) - len(header) + 1):
        if chat_ids[start:start + len(header)] == header:
            first = start + len(header)
            end = chat_ids.index(eot, first)  # the turn's end-of-turn token, trained too
            chat_targets += range(first, end + 1)
            turns.append(tokenizer.decode(chat_ids[first:end]))
    assert turns == [m["content"] for m in MESSAGES if m["role"] == "assistant"]  # the spans are the turns
    return [(text_ids, text_targets), (pc_ids, pc_targets), (chat_ids, chat_targets)]


def reference_loss(model, documents) -> tuple[float, int]:
    """(mean cross-entropy over the target positions, number of targets): each document alone in a row of
    its own (right-padded: causal attention keeps padding out of earlier positions), float64 log-softmax of
    the model's logits in numpy."""
    ids_bt = np.full((len(documents), SEQ_LEN), PAD, np.int32)
    for row, (ids, _) in enumerate(documents):
        ids_bt[row, :len(ids)] = ids
    logits_btv = np.asarray(jax.jit(lambda ids: model(ids))(jnp.asarray(ids_bt))).astype(np.float64)
    shifted = logits_btv - logits_btv.max(-1, keepdims=True)
    log_probs_btv = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    total, count = 0.0, 0
    for row, (ids, targets) in enumerate(documents):
        total -= sum(log_probs_btv[row, j - 1, ids[j]] for j in targets)  # token j is predicted at j - 1
        count += len(targets)
    return total / count, count


def hand_schedule(step: int, *, lr: float, warmup: int, steps: int, kind: str, min_ratio: float) -> float:
    """The learning rate of update `step` (0-based): linear warm-up from 0 over `warmup` updates, then
    cosine or linear decay to `lr * min_ratio` over the remaining updates, or constant."""
    if step < warmup:
        return lr * step / warmup
    progress = (step - warmup) / max(steps - warmup, 1)
    end = lr * min_ratio
    if kind == "cosine":
        return end + (lr - end) * 0.5 * (1 + math.cos(math.pi * progress))
    if kind == "linear":
        return lr + (end - lr) * progress
    return lr


def pipeline_batch(tokenizer, pack: bool) -> dict[str, jax.Array]:
    """The rows through the data pipeline, as one batch of 3 rows (packed rows padded with empty ones)."""
    rows, truncated = build_rows(tokenize(ROWS, tokenizer), SEQ_LEN, pack=pack)
    assert truncated == 0
    rows = rows.padded_to_multiple(len(ROWS))
    return {k: jnp.asarray(v) for k, v in rows.take(np.arange(len(rows))).items()}


def flat(tree) -> dict[str, np.ndarray]:
    return {".".join(map(str, k)): np.asarray(v[...]) for k, v in nnx.to_flat_state(tree)}


@pytest.fixture(scope="module")
def loss_fn(model):
    graphdef, lora, base = split_model(model)
    fn = jax.jit(lambda lora, batch: loss_and_grads(graphdef, lora, base, batch))
    return lambda batch: fn(lora, batch)


# ---- the loss ---------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("pack", [True, False])
def test_loss_is_the_cross_entropy_of_exactly_the_promised_targets(tokenizer, model, loss_fn, pack):
    """A text, a prompt/completion and a two-turn chat row through tokenize -> build_rows -> loss_and_grads:
    the loss is the mean token cross-entropy over exactly the targets the row formats promise, and the
    target count is theirs."""
    documents = expected_documents(tokenizer)
    expected, count = reference_loss(model, documents)
    batch = pipeline_batch(tokenizer, pack)
    if not pack:  # one document per row: the pipeline's tokens are the reference's
        for row, (ids, _) in enumerate(documents):
            assert np.asarray(batch["input_ids"])[row, :len(ids)].tolist() == ids
    loss, tokens, _ = loss_fn(batch)
    assert int(tokens) == count
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5)


def masked_and_trained_positions(batch) -> tuple[np.ndarray, np.ndarray]:
    mask = np.asarray(batch["loss_mask"]) > 0
    real = np.asarray(batch["segment_ids"]) != 0
    return np.argwhere(real & ~mask), np.argwhere(mask)


def with_target(batch, positions, vocab: int) -> dict[str, jax.Array]:
    targets = np.asarray(batch["targets"]).copy()
    for r, c in positions:
        targets[r, c] = (targets[r, c] + 1 + r + c) % vocab
    return {**batch, "targets": jnp.asarray(targets)}


def test_masked_targets_change_nothing_and_trained_targets_change_the_loss(tokenizer, model, loss_fn):
    """Every prompt, user, header and end-of-document position gets another label: loss and LoRA gradients
    stay bit-identical. Another label at one trained position changes both."""
    batch = pipeline_batch(tokenizer, pack=True)
    masked, trained = masked_and_trained_positions(batch)
    assert len(masked) > 20 and len(trained) > 10
    vocab = model.config.vocab_size
    loss, tokens, grads = loss_fn(batch)
    loss2, tokens2, grads2 = loss_fn(with_target(batch, masked, vocab))
    assert float(loss2) == float(loss) and float(tokens2) == float(tokens)
    for name, g in flat(grads2).items():
        np.testing.assert_array_equal(g, flat(grads)[name], err_msg=name)
    loss3, _, grads3 = loss_fn(with_target(batch, trained[-1:], vocab))
    assert float(loss3) != float(loss)
    assert any(not np.array_equal(g, flat(grads)[name]) for name, g in flat(grads3).items())


# ---- the learning rate ------------------------------------------------------------------------------

MINI = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8)


@pytest.fixture(scope="module")
def mini():
    """(a one-layer model with non-zero LoRA B on q/v, a batch of random tokens): the optimizer's behaviour
    does not depend on the model, and this one compiles a train step in a few seconds."""
    lora_config = LoraConfig(rank=4, alpha=8, targets=("q_proj", "v_proj"))
    model = apply_lora(CausalLM(MINI, rngs=nnx.Rngs(0)), lora_config, rngs=nnx.Rngs(1))
    for i, (_, linear) in enumerate(target_linears(model, ("q_proj", "v_proj"))):
        linear.lora_b.set_value(0.05 * jax.random.normal(jax.random.key(i), linear.lora_b[...].shape))
    ids = np.random.default_rng(0).integers(0, MINI.vocab_size, (2, 17)).astype(np.int32)
    mask = np.ones((2, 16), np.float32)
    batch = {"input_ids": ids[:, :-1], "targets": ids[:, 1:], "loss_mask": mask,
             "segment_ids": np.ones((2, 16), np.int32), "positions": np.tile(np.arange(16, dtype=np.int32), (2, 1))}
    return model, {k: jnp.asarray(v) for k, v in batch.items()}


def step_config(**kw) -> TrainConfig:
    values = {"model": "m", "data": "d", "out": "o", "steps": 8, "warmup_steps": 3, "lr": 1e-2, "min_lr_ratio": 0.1,
              "batch_size": 2, "dtype": "float32"}
    values.update(kw)
    return TrainConfig(**values).validate()


def train_states(model, batch, config: TrainConfig, steps: int):
    """(initial LoRA, [(state, metrics)] after each of `steps` real train steps from fresh optimizer state)."""
    graphdef, lora, base = split_model(model)
    tx, schedule = make_optimizer(config)
    train_step, _ = build_steps(graphdef, schedule, tx, config.grad_accum)
    train_step = jax.jit(train_step)
    state = TrainState(jnp.int32(0), lora, tx.init(lora), jax.random.key(0))
    out = []
    for _ in range(steps):
        state, metrics = train_step(state, base, batch)
        out.append((state, jax.device_get(metrics)))
    return lora, out


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["cosine", "linear", "constant"])
def test_learning_rate_follows_the_hand_written_schedule(mini, kind):
    """The logged `lr` of step k and the step AdamW actually takes equal the schedule's value at k - 1.

    With b1 = b2 = 0 and a negligible epsilon AdamW's step is `-lr * g / |g|`: every LoRA entry moves by
    exactly the learning rate, up to the float32 rounding of the parameter (one ulp) and of the schedule
    (1e-6 relative)."""
    model, batch = mini
    config = step_config(schedule=kind, adam_b1=0.0, adam_b2=0.0, adam_eps=1e-30, clip_norm=0.0)
    lora, states = train_states(model, batch, config, config.steps)
    expected = [hand_schedule(s, lr=config.lr, warmup=config.warmup_steps, steps=config.steps, kind=kind,
                              min_ratio=config.min_lr_ratio) for s in range(config.steps)]
    logged = [float(m["lr"]) for _, m in states]
    np.testing.assert_allclose(logged, expected, rtol=1e-6, atol=0)  # float32 schedule arithmetic
    # the first step, both sides of the warm-up boundary and the last step, spelled out
    assert logged[0] == 0.0
    assert logged[2] == pytest.approx(config.lr * 2 / 3, rel=1e-6) and logged[3] == pytest.approx(config.lr, rel=1e-6)
    last = {"cosine": 0.1e-2 + 0.9e-2 * 0.5 * (1 + math.cos(math.pi * 4 / 5)), "linear": 1e-2 - 0.9e-2 * 4 / 5,
            "constant": 1e-2}[kind]
    assert logged[-1] == pytest.approx(last, rel=1e-6)
    previous = flat(lora)
    for s, (state, _) in enumerate(states):
        current = flat(state.lora)
        for name, value in current.items():
            moved = np.abs(value.astype(np.float64) - previous[name])
            ulp = np.spacing(np.maximum(np.abs(value), np.abs(previous[name])))
            np.testing.assert_array_less(np.abs(moved - expected[s]), ulp + 1e-6 * expected[s] + 1e-30,
                                         err_msg=f"step {s + 1}: {name}")
        previous = current


# ---- clipping ---------------------------------------------------------------------------------------


def first_moment(state) -> list[np.ndarray]:
    """AdamW's first moment; with b1 = 0 after one step, the gradient AdamW received."""
    return [np.asarray(x, np.float64) for x in jax.tree.leaves(optax.tree.get(state.opt_state, "mu"))]


def global_norm(arrays) -> float:
    return math.sqrt(sum(float((x * x).sum()) for x in arrays))


@pytest.mark.slow
def test_clipping_hands_adamw_a_gradient_of_norm_clip_norm(mini):
    """`--clip-norm 0`: AdamW receives the gradient `g` itself (its norm is the logged `grad_norm`).
    `--clip-norm c` with `c = |g| / 1000`: AdamW receives `g * c / |g|`, of global norm `c`."""
    model, batch = mini

    def one_step(clip_norm: float):
        config = load_config(["--model", "m", "--data", "d", "--out", "o", "--batch-size", "2", "--steps", "2",
                              "--clip-norm", repr(clip_norm), "--adam-b1", "0", "--dtype", "float32"],
                             "finetune-lora", "")
        assert config.clip_norm == clip_norm
        _, [(state, metrics)] = train_states(model, batch, config, 1)
        return first_moment(state), float(metrics["grad_norm"])

    g, g_norm = one_step(0.0)
    np.testing.assert_allclose(global_norm(g), g_norm, rtol=1e-5)
    c = g_norm / 1000
    clipped, logged_norm = one_step(c)
    assert logged_norm == g_norm  # the logged norm is the one before clipping
    np.testing.assert_allclose(global_norm(clipped), c, rtol=1e-5)
    for got, want in zip(clipped, g):
        np.testing.assert_allclose(got, want * (c / g_norm), rtol=1e-5, atol=1e-7 * c)
