"""Policy-gradient objectives (finetune.step.policy) against TRL 1.16's GRPOTrainer: its loss and LoRA gradients on
fixed prompts, completions, advantages and old and reference log-probabilities, for every loss type at the token and
the sequence level (GSPO), where the ratios fall outside the clip range on both sides, the advantages take both signs,
the adapter is nonzero and `beta` > 0 (at a first iteration the ratio is 1 and none of that could fail), the KL
weighed by the ratio as TRL's default `use_bias_correction_kl` does; and the advantages TRL computes from rewards."""

import numpy as np
import pytest
import torch

from finetune.step.policy import PolicyObjective, group_advantages

B, P, C = 4, 3, 5  # completions, prompt tokens, completion tokens
COMPLETION_MASK = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 0, 0, 0, 0]])
ADVANTAGES = np.array([1.0, -0.5, 0.7, -1.2], np.float32)


@pytest.fixture(scope="module")
def trl_case(tiny_checkpoint, tmp_path_factory):
    """A PEFT model of the tiny Llama (q_proj and v_proj, random A and B), a GRPOTrainer around it, and fixed
    inputs: prompts, completions, their masks and advantages; the old and reference log-probabilities are the
    policy's own moved by up to +-0.6 (ratios from 0.55 to 1.8 against a clip range of [0.8, 1.3])."""
    from datasets import Dataset
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                  init_lora_weights=False))
    adapter = tmp_path_factory.mktemp("policy") / "adapter"
    peft_model.save_pretrained(adapter)
    rng = np.random.default_rng(0)
    prompt_ids = rng.integers(6, 512, (B, P))
    completion_ids = rng.integers(6, 512, (B, C))
    args = dict(output_dir=str(adapter.parent / "trl"), per_device_train_batch_size=B, num_generations=2,
                max_completion_length=C, report_to=[], use_cpu=True, bf16=False, temperature=0.7)
    with torch.no_grad():
        ids = torch.tensor(np.concatenate([prompt_ids, completion_ids], axis=1))
        logits = peft_model(ids).logits[:, P - 1:-1] / 0.7
        logps = torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion_ids)[..., None])[..., 0].numpy()
    shift = lambda: rng.choice([-0.6, -0.3, 0.3, 0.6], (B, C)).astype(np.float32)  # noqa: E731
    inputs = dict(prompt_ids=prompt_ids, completion_ids=completion_ids, old=logps + shift(), ref=logps + shift())
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)

    def trl_loss_and_grads(**config):  # on a model of its own: a trainer patches it (its LM head, a "ref" adapter)
        peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_checkpoint,
                                                                                    dtype=torch.float32),
                                               adapter, is_trainable=True)
        trainer = GRPOTrainer(model=peft_model, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                              args=GRPOConfig(**args, **config), processing_class=tokenizer,
                              train_dataset=Dataset.from_dict({"prompt": ["a", "b"]}))
        trainer.current_gradient_accumulation_steps = 1
        peft_model.zero_grad()
        loss = trainer._compute_loss(peft_model, {
            "prompt_ids": torch.tensor(prompt_ids), "prompt_mask": torch.ones(B, P, dtype=torch.long),
            "completion_ids": torch.tensor(completion_ids), "completion_mask": torch.tensor(COMPLETION_MASK),
            "advantages": torch.tensor(ADVANTAGES), "old_per_token_logps": torch.tensor(inputs["old"]),
            "ref_per_token_logps": torch.tensor(inputs["ref"]),
            "num_items_in_batch": torch.tensor(float(COMPLETION_MASK.sum()))})
        loss.backward()
        grads = {k.replace(".default", ""): p.grad.numpy().copy() for k, p in peft_model.named_parameters()
                 if p.requires_grad}
        metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
        return float(loss), grads, metrics

    ratios = np.exp(logps - inputs["old"])[COMPLETION_MASK == 1]
    assert (ratios < 0.8).any() and (ratios > 1.3).any()
    return adapter, inputs, trl_loss_and_grads


def rollout_batch(inputs: dict, grad_accum: int = 1) -> dict[str, np.ndarray]:
    """The inputs as a rollout batch (finetune.rollout.batch.rollout_rows: one row a completion, its old and
    reference log-probabilities at the positions that predict its tokens)."""
    from finetune.rollout.batch import rollout_rows

    return rollout_rows(inputs["prompt_ids"], np.ones((B, P), np.int32), inputs["completion_ids"],
                        COMPLETION_MASK.sum(axis=1), ADVANTAGES, inputs["old"], grad_accum, ref_logps=inputs["ref"])


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_the_loss_and_lora_gradients_are_trls(trl_case, tiny_converted, loss_type, level):
    import jax
    import jax.numpy as jnp

    from finetune.step.train_step import policy_loss_and_grads, split_model
    from jaxmodel import load_pretrained
    from jaxmodel.formats.peft_adapter import load_peft_adapter, peft_tensors

    adapter, inputs, trl_loss_and_grads = trl_case
    config = dict(loss_type=loss_type, importance_sampling_level=level, beta=0.1, epsilon=0.2, epsilon_high=0.3)
    expected, theirs, trl_metrics = trl_loss_and_grads(**config)
    objective = PolicyObjective(**config, max_completion_length=C, temperature=0.7)
    model = load_peft_adapter(load_pretrained(tiny_converted), adapter)
    graphdef, lora, base = split_model(model)
    batch = {k: jnp.asarray(v) for k, v in rollout_batch(inputs).items()}
    loss, tokens, grads, metrics = jax.jit(
        lambda lora, base, batch: policy_loss_and_grads(graphdef, lora, base, batch, objective, B, B))(
        lora, base, batch)
    assert float(tokens) == COMPLETION_MASK.sum()
    assert abs(float(loss) - expected) <= 1e-5 * max(1.0, abs(expected)), (float(loss), expected)
    ours = peft_tensors(grads, model.config)
    assert sorted(ours) == sorted(theirs)
    for name, grad in ours.items():
        scale = np.abs(theirs[name]).max()
        assert scale > 0, name
        np.testing.assert_allclose(grad, theirs[name], rtol=0, atol=1e-4 * max(1.0, scale), err_msg=name)
    for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "kl"):
        assert abs(float(metrics[name]) - trl_metrics[name]) <= 1e-5 * max(1.0, abs(trl_metrics[name])), name
    if level == "token":
        assert 0 < trl_metrics["clip_ratio/low_mean"] and 0 < trl_metrics["clip_ratio/high_mean"]


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_advantages_are_trls(scale_rewards):
    """Two reward functions weighted, one not applicable (None: NaN) to some completions and to every function of
    one completion; a group whose rewards are all equal; against TRL's own computation."""
    rewards = np.array([[1.0, 0.5], [0.0, np.nan], [2.0, 1.0], [np.nan, np.nan], [0.3, 0.3], [0.3, 0.3],
                        [1.5, np.nan], [-1.0, 0.25]], np.float32)
    weights = np.array([1.0, 0.5], np.float32)
    got, zero_spread = group_advantages(rewards, weights, 2, scale_rewards)
    expected, expected_zero = trl_advantages(rewards, weights, 2, scale_rewards)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(zero_spread, expected_zero)
    assert got[3] == 0 and (got[4:6] == 0).all() and (got != 0).sum() >= 4


def trl_advantages(rewards: np.ndarray, weights: np.ndarray, num_generations: int, scale_rewards: str):
    """TRL 1.16's advantages (GRPOTrainer._generate_and_score_completions, sum_then_normalize), in torch."""
    from trl.trainer.utils import nanstd

    per_func, w = torch.tensor(rewards), torch.tensor(weights)
    unscorable = torch.isnan(per_func).all(dim=1)
    total = (per_func * w.unsqueeze(0)).nansum(dim=1)
    total[unscorable] = torch.nan
    mean = torch.nanmean(total.view(-1, num_generations), dim=1).repeat_interleave(num_generations, dim=0)
    if scale_rewards == "batch":
        std = nanstd(total).expand_as(total)
    else:
        std = nanstd(total.view(-1, num_generations), dim=1).repeat_interleave(num_generations, dim=0)
    advantages = total - mean
    if scale_rewards != "none":
        advantages = advantages / (std + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0).numpy(), torch.isclose(std, torch.zeros_like(std)).numpy()


@pytest.mark.slow
def test_micro_batches_split_the_loss_as_trls_accumulation_does(trl_case, tiny_converted):
    """Two micro-batches: grpo, dr_grpo and dapo give the one-batch loss and gradients; bnpo the mean of the two
    micro-batches' own token means (TRL's per-micro-batch normaliser)."""
    import jax
    import jax.numpy as jnp

    from finetune.step.train_step import policy_loss_and_grads, split_model
    from jaxmodel import load_pretrained
    from jaxmodel.formats.peft_adapter import load_peft_adapter

    adapter, inputs, _ = trl_case
    graphdef, lora, base = split_model(load_peft_adapter(load_pretrained(tiny_converted), adapter))

    def run(loss_type, batch, accum, sequences=B):
        objective = PolicyObjective(loss_type, beta=0.1, max_completion_length=C, temperature=0.7)
        return jax.jit(lambda lora, base, batch: policy_loss_and_grads(
            graphdef, lora, base, batch, objective, sequences // accum, sequences, accum))(lora, base, batch)

    whole = {k: jnp.asarray(v) for k, v in rollout_batch(inputs).items()}
    split = {k: jnp.asarray(v) for k, v in rollout_batch(inputs, 2).items()}
    for loss_type in ("grpo", "dr_grpo", "dapo", "bnpo"):
        loss, _, grads, _ = run(loss_type, split, 2)
        if loss_type == "bnpo":
            halves = [run(loss_type, {k: v[np.array(rows)] for k, v in split.items()}, 1, 2)
                      for rows in ([0, 2], [1, 3])]
            expected = (sum(h[0] for h in halves) / 2, jax.tree.map(lambda a, b: (a + b) / 2, halves[0][2],
                                                                   halves[1][2]))
            assert abs(float(run(loss_type, whole, 1)[0]) - float(expected[0])) > 1e-4  # the split matters
        else:
            one = run(loss_type, whole, 1)
            expected = (one[0], one[2])
        assert abs(float(loss) - float(expected[0])) <= 1e-6, loss_type
        for (path, g), (_, e) in zip(jax.tree_util.tree_leaves_with_path(grads),
                                     jax.tree_util.tree_leaves_with_path(expected[1])):
            np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=0, atol=1e-6 * max(1.0, np.abs(e).max()),
                                       err_msg=f"{loss_type} {path}")


@pytest.fixture(scope="module")
def trl_rloo(trl_case, tiny_checkpoint):
    """TRL's RLOOTrainer loss and LoRA gradients on trl_case's inputs: its old log-probability a completion's sum of
    the old per-token ones over its mask."""
    from datasets import Dataset
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import RLOOConfig, RLOOTrainer

    adapter, inputs, _ = trl_case

    def loss_and_grads(**config):
        peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_checkpoint,
                                                                                    dtype=torch.float32),
                                               adapter, is_trainable=True)
        trainer = RLOOTrainer(model=peft_model, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                              args=RLOOConfig(output_dir=str(adapter.parent / "rloo"), per_device_train_batch_size=B,
                                              num_generations=2, max_completion_length=C, report_to=[],
                                              use_cpu=True, bf16=False, temperature=0.7, **config),
                              processing_class=AutoTokenizer.from_pretrained(tiny_checkpoint),
                              train_dataset=Dataset.from_dict({"prompt": ["a", "b"]}))
        peft_model.zero_grad()
        loss = trainer._compute_loss(peft_model, {
            "prompt_ids": torch.tensor(inputs["prompt_ids"]), "prompt_mask": torch.ones(B, P, dtype=torch.long),
            "completion_ids": torch.tensor(inputs["completion_ids"]),
            "completion_mask": torch.tensor(COMPLETION_MASK), "advantages": torch.tensor(ADVANTAGES),
            "old_logps": torch.tensor((inputs["old"] * COMPLETION_MASK).sum(1))})
        loss.backward()
        grads = {k.replace(".default", ""): p.grad.numpy().copy() for k, p in peft_model.named_parameters()
                 if p.requires_grad}
        return float(loss), grads, {k: v[-1] for k, v in trainer._metrics["train"].items()}

    return loss_and_grads


@pytest.mark.slow
def test_rloos_loss_and_lora_gradients_are_trls(trl_case, trl_rloo, tiny_converted):
    """RLOO's ratio is a completion's summed log-ratio (here from 0.1 to 9.6: clipped on both sides), its loss the
    mean over completions, its KL in the rewards (so none in the loss, whatever beta)."""
    import jax
    import jax.numpy as jnp

    from finetune.step.train_step import policy_loss_and_grads, split_model
    from jaxmodel import load_pretrained
    from jaxmodel.formats.peft_adapter import load_peft_adapter, peft_tensors

    adapter, inputs, _ = trl_case
    expected, theirs, trl_metrics = trl_rloo(epsilon=0.2, epsilon_high=0.3, beta=0.05)
    objective = PolicyObjective("rloo", epsilon=0.2, epsilon_high=0.3, beta=0.05, temperature=0.7)
    model = load_peft_adapter(load_pretrained(tiny_converted), adapter)
    graphdef, lora, base = split_model(model)
    batch = {k: jnp.asarray(v) for k, v in rollout_batch(inputs).items()}
    loss, _, grads, metrics = jax.jit(lambda lora, base, batch: policy_loss_and_grads(
        graphdef, lora, base, batch, objective, B, B))(lora, base, batch)
    assert abs(float(loss) - expected) <= 1e-5 * max(1.0, abs(expected)), (float(loss), expected)
    ours = peft_tensors(grads, model.config)
    for name, grad in ours.items():
        np.testing.assert_allclose(grad, theirs[name], rtol=0, atol=1e-4 * max(1.0, np.abs(theirs[name]).max()),
                                   err_msg=name)
    for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
        assert abs(float(metrics[name]) - trl_metrics[name]) <= 1e-6, name
    assert trl_metrics["clip_ratio/low_mean"] > 0 and trl_metrics["clip_ratio/high_mean"] > 0 and "kl" not in metrics


@pytest.mark.parametrize("normalize, clip_range", [(False, None), (True, (-0.5, 1.8))])
def test_rloos_leave_one_out_advantages_are_trls(normalize, clip_range):
    """Groups of three with None rewards (a group with one scorable completion gets 0), the KL penalty in the
    rewards, clipped and normalised or not: against TRL's own computation."""
    from finetune.step.policy import leave_one_out_advantages

    rewards = np.array([[1.0, 0.5], [0.0, np.nan], [2.0, 1.0], [np.nan, np.nan], [0.3, np.nan], [np.nan, np.nan],
                        [1.5, 0.2], [-1.0, 0.25], [0.7, 0.7]], np.float32)
    weights, kl = np.array([1.0, 0.5], np.float32), np.linspace(-0.4, 0.8, 9).astype(np.float32)
    got = leave_one_out_advantages(rewards, weights, 3, kl, 0.05, normalize, clip_range)
    np.testing.assert_allclose(got, trl_rloo_advantages(rewards, weights, 3, kl, 0.05, normalize, clip_range),
                               rtol=1e-6, atol=1e-6)
    assert got[3] == 0 and got[4] == 0 and got[5] == 0 and (got != 0).sum() >= 5


def trl_rloo_advantages(rewards, weights, num_generations, kl, beta, normalize, clip_range):
    """TRL 1.16's RLOO advantages (RLOOTrainer._generate_and_score_completions), in torch."""
    from trl.trainer.utils import nanstd

    per_func = torch.tensor(rewards)
    unscorable = torch.isnan(per_func).all(dim=1)
    total = (per_func * torch.tensor(weights).unsqueeze(0)).nansum(dim=1)
    total[unscorable] = torch.nan
    if clip_range:
        total = total.clamp(min=clip_range[0], max=clip_range[1])
    total = total - beta * torch.tensor(kl)
    grouped = total.view(-1, num_generations)
    counts = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
    baselines = ((torch.nansum(grouped, dim=1, keepdim=True) - grouped) / (counts - 1)).view(-1)
    advantages = total - baselines
    if normalize:
        advantages = (advantages - torch.nanmean(advantages)) / (nanstd(advantages) + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0).numpy()
