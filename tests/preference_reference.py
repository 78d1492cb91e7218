"""Independent torch references for the preference objectives (DPO, IPO, SimPO, ORPO) of LoRA training: the
step-1 loss of one batch and its gradient with respect to every LoRA parameter, computed (a) by a plain torch
implementation of the definitions below (`torch_reference`) and (b) by TRL's own trainers (`trl_reference`).
The JAX implementation is tested against these. Needs the `[torch]` and `[test]` extras (TRL pinned in
constraints.txt).

Definitions (the toolkit's)
---------------------------
A batch is a list of pairs `{"prompt": x, "chosen": y_c, "rejected": y_r}` (strings).

Tokenization is the SFT prompt-completion one of `finetune/data/reference.py`: the prompt is
`[BOS] + tokenizer.encode(prompt, add_special_tokens=False)` (what `tokenizer(prompt)` gives for a Llama 3
tokenizer, whose special tokens are BOS only); each completion is encoded on its own with
`add_special_tokens=False`, then EOS is appended. The completion's tokens (EOS included) are the ones counted;
prompt and padding tokens never are. `encode_pair` does this.

- `logp(y|x)`: the sum over the completion's tokens of log p(token | everything before it).
- `a`: the per-token mean of a completion's logp, `logp / number of its tokens` (EOS included).
- `ref` / `aref`: the same for the reference model, which is the base model with the LoRA off (PEFT's
  `with model.disable_adapter():`), under no_grad.
- `s`: the logistic sigmoid; `b`: beta.

Per pair:

- DPO:   `-(1-e) log s(b D) - e log s(-b D)`, `D = (logp_c - ref_c) - (logp_r - ref_r)`,
         `e` = label smoothing (conservative DPO), 0 by default.
- IPO:   `((a_c - aref_c) - (a_r - aref_r) - 1/(2b))^2`.
- SimPO: `-log s(b (a_c - a_r) - gamma)`.
- ORPO:  `NLL - lambda log s(log_odds)`, `NLL = -a_c` (the mean, over the chosen completion's tokens, of their
         negative log-prob), `log_odds = (a_c - a_r) - (log(1 - e^a_c) - log(1 - e^a_r))`.

The loss is the mean of these over the pairs of the batch.

What the functions return
-------------------------
`torch_reference` and `trl_reference` take a transformers `LlamaForCausalLM` (float32) wrapped in a PEFT LoRA
`PeftModel` (adapter "default"), its tokenizer, the pairs, the objective ("dpo", "ipo", "simpo", "orpo") and its
hyper-parameters, and return a `Reference`: `loss` (a float) and `grads`, the gradient of that loss with respect
to every LoRA parameter, keyed by the names PEFT writes to `adapter_model.safetensors`
(`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`, i.e. the parameter name without the adapter
name). The model given is left unchanged (TRL works on a deep copy of it).

`torch_reference` runs one forward per sequence (no padding), gathers `log_softmax` at the next token, selects the
completion tokens by position, and differentiates with `torch.autograd.grad`; its `Reference.terms` holds the
per-pair quantities (logps, reference logps, token counts) for debugging a mismatch.

`trl_reference` builds TRL's trainer on ONE batch holding all pairs, in order (no shuffling), on CPU in float32
(`bf16=False`, TRL's default is True), dropout off (`disable_dropout=True`, and the LoRA dropout should be 0),
no gradient checkpointing, no truncation, reference log-probs not precomputed, and calls the trainer's
`compute_loss(model, batch)` on the batch its own data collator makes of its own tokenized dataset, then
`loss.backward()`. The base model and the `LoraConfig` are handed to the trainer (`peft_config=...`, no
`ref_model`): TRL wraps the model itself, which makes its reference "adapter disabled" (given an already-wrapped
`PeftModel`, TRL 1.16 would instead copy the adapter into a frozen "ref" adapter, a reference equal to the policy
at step 1); the adapter's weights are then loaded into TRL's PEFT model. TRL tokenizes the strings itself;
`trl_reference` checks that its token ids equal `encode_pair`'s and raises if not (see below).

Where TRL (1.16.0) differs from the definitions above
------------------------------------------------------
- Tokenization. TRL tokenizes `prompt + completion` as one string and takes the completion's tokens as what
  follows the prompt's tokens (DPO: the common prefix of `tokenizer(prompt)` and `tokenizer(prompt + completion
  + eos_token)`; CPO/ORPO: `enc(prompt + completion)[len(enc(prompt)):]`, BOS and EOS ids added if missing).
  The toolkit encodes the completion on its own. They agree when no token spans the prompt/completion boundary
  (a byte-level BPE with completions that start with a space and prompts that do not end in one). DPOTrainer
  takes BOS from `tokenizer(prompt)`, so the tokenizer must add BOS (Llama 3's does; `add_bos_token=True` for
  others); CPO/ORPO prepend BOS themselves. `trl_reference` raises if TRL's ids differ from `encode_pair`'s.
- DPO label smoothing. TRL >= 0.29 (so 1.16) ignores `label_smoothing` for `loss_type="sigmoid"` (it is
  plain `-log s(b D)`); `label_smoothing` only enters "robust", "exo_pair" and "aot". For `e > 0`,
  `trl_reference` uses TRL's loss combination `loss_type=["sigmoid", "robust"]`, `loss_weights=[2(1-e),
  -(1-2e)]`: with `A = -log s(bD)`, `B = -log s(-bD)` and TRL's robust term `((1-e)A - eB)/(1-2e)`, this is
  `2(1-e)A - ((1-e)A - eB) = (1-e)A + eB`, the definition, from TRL's own per-pair terms (so `e < 0.5` only).
- IPO: TRL divides each side's (policy - reference) logp difference by the completion's token count, i.e.
  `(a_c - aref_c) - (a_r - aref_r)`: the definition.
- SimPO: TRL's CPOTrainer with `loss_type="simpo"` averages the logps over the completion tokens (`a`) and
  computes `-log s(b ((a_c - a_r) - gamma/b))` (times `1 - label_smoothing`, plus `label_smoothing` times the
  flipped term; label smoothing is 0 here), and `cpo_alpha=0` drops its NLL term: the definition.
- ORPO (ORPOTrainer, TRL's `beta` is `lambda`): the odds-ratio term is the definition (a = mean logp over the
  completion tokens incl. EOS; `log1mexp` for `log(1 - e^a)`), but TRL's NLL is NOT `mean over pairs of -a_c`:
  it is `nn.CrossEntropyLoss()` over every non-padding next-token of the chosen sequences, PROMPT TOKENS INCLUDED
  (every token after the first, BOS), averaged over all those tokens of the batch together (a token-weighted
  mean, not a mean of per-pair means):
  `NLL_trl = sum_i sum_{t=1}^{L_i - 1} -log p(x_{i,t} | x_{i,<t}) / sum_i (L_i - 1)`, `L_i` = prompt + chosen
  length. So for ORPO `trl_reference` returns TRL's value in `loss`/`grads` and, in `.stated`, the definition
  computed from TRL's own pieces (its tokenization, forward, `get_batch_logps`, `odds_ratio_loss`) with only the
  NLL replaced by `mean(-a_c)` (from TRL's average logps). `trl_orpo_nll` computes TRL's NLL in plain torch.
"""

from __future__ import annotations

import copy
import re
import tempfile
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

OBJECTIVES = ("dpo", "ipo", "simpo", "orpo")


@dataclass
class Reference:
    """A step-1 loss and its gradient with respect to every LoRA parameter (PEFT safetensors names)."""

    loss: float
    grads: dict[str, torch.Tensor]
    # trl_reference only: where TRL's definition differs from the toolkit's (ORPO's NLL), the toolkit's definition
    # computed from TRL's own pieces. None where they agree.
    stated: Reference | None = None
    # torch_reference only: per-pair tensors (logp_chosen, logp_rejected, ref_chosen, ref_rejected, n_chosen,
    # n_rejected, and the objective's per-pair loss).
    terms: dict[str, torch.Tensor] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------------------------
# Shared helpers


def encode_pair(tokenizer, pair: Mapping[str, str]) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, chosen ids, rejected ids): `[BOS] + encode(prompt)`, `encode(completion) + [EOS]` each,
    encoded without special tokens (the toolkit's SFT prompt-completion tokenization)."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []

    def enc(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    return bos + enc(pair["prompt"]), enc(pair["chosen"]) + eos, enc(pair["rejected"]) + eos


def peft_name(name: str, adapter: str = "default") -> str:
    """A PeftModel parameter's name as `adapter_model.safetensors` has it: without the adapter's name."""
    return re.sub(rf"\.{re.escape(adapter)}(?=\.|$)", "", name)


def lora_parameters(model, adapter: str = "default") -> dict[str, torch.nn.Parameter]:
    """The LoRA parameters of a PeftModel, by PEFT safetensors name."""
    params = {peft_name(n, adapter): p for n, p in model.named_parameters()
              if "lora_" in n and f".{adapter}." in f"{n}."}
    if not params:
        raise ValueError(f"no LoRA parameters of adapter {adapter!r} in the model")
    return params


def _check_objective(objective: str) -> None:
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - e^x) for x < 0, without cancellation."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


# ---------------------------------------------------------------------------------------------------------------
# (a) plain torch


def _completion_logps(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """Per-token log-probs of `completion` after `prompt`: one forward of the unpadded sequence, `log_softmax`
    gathered at each next token, the completion's positions selected by position."""
    ids = torch.tensor([prompt + completion], dtype=torch.long, device=model.device)
    logits = model(input_ids=ids, use_cache=False).logits[0].float()  # [L, V]
    logprobs = torch.log_softmax(logits[:-1], dim=-1)  # position t predicts token t + 1
    targets = ids[0, 1:]
    token_logps = logprobs.gather(1, targets[:, None])[:, 0]  # [L - 1]: log p(ids[t] | ids[<t]), t = 1..L-1
    counted = torch.arange(1, ids.shape[1], device=ids.device) >= len(prompt)
    return token_logps[counted]


def torch_reference(model, tokenizer, pairs: Sequence[Mapping[str, str]], objective: str, beta: float = 0.1,
                    label_smoothing: float = 0.0, simpo_gamma: float = 0.5, orpo_lambda: float = 0.1) -> Reference:
    """The step-1 loss of `pairs` (one batch) under `objective`, and its gradient with respect to every LoRA
    parameter of `model` (a PeftModel), by the module docstring's definitions, in plain torch."""
    _check_objective(objective)
    params = lora_parameters(model)
    was_training = model.training
    model.eval()  # dropout off
    try:
        encoded = [encode_pair(tokenizer, pair) for pair in pairs]
        terms: dict[str, torch.Tensor] = {}
        for side, index in (("chosen", 1), ("rejected", 2)):
            per_token = [_completion_logps(model, enc[0], enc[index]) for enc in encoded]
            terms[f"logp_{side}"] = torch.stack([t.sum() for t in per_token])
            terms[f"n_{side}"] = torch.tensor([float(len(enc[index])) for enc in encoded], device=model.device)
            if objective in ("dpo", "ipo"):
                with torch.no_grad(), model.disable_adapter():
                    terms[f"ref_{side}"] = torch.stack(
                        [_completion_logps(model, enc[0], enc[index]).sum() for enc in encoded])
        logp_c, logp_r = terms["logp_chosen"], terms["logp_rejected"]
        a_c, a_r = logp_c / terms["n_chosen"], logp_r / terms["n_rejected"]
        if objective == "dpo":
            d = (logp_c - terms["ref_chosen"]) - (logp_r - terms["ref_rejected"])
            e = label_smoothing
            losses = -(1 - e) * F.logsigmoid(beta * d) - e * F.logsigmoid(-beta * d)
        elif objective == "ipo":
            aref_c, aref_r = terms["ref_chosen"] / terms["n_chosen"], terms["ref_rejected"] / terms["n_rejected"]
            losses = ((a_c - aref_c) - (a_r - aref_r) - 1 / (2 * beta)) ** 2
        elif objective == "simpo":
            losses = -F.logsigmoid(beta * (a_c - a_r) - simpo_gamma)
        else:  # orpo
            log_odds = (a_c - a_r) - (_log1mexp(a_c) - _log1mexp(a_r))
            losses = -a_c - orpo_lambda * F.logsigmoid(log_odds)
        terms["loss"] = losses
        loss = losses.mean()
        grads = torch.autograd.grad(loss, list(params.values()))
    finally:
        model.train(was_training)
    return Reference(loss=loss.item(), grads={n: g.detach().cpu() for n, g in zip(params, grads)},
                     terms={k: v.detach().cpu() for k, v in terms.items()})


def trl_orpo_nll(model, tokenizer, pairs: Sequence[Mapping[str, str]]) -> float:
    """TRL ORPOTrainer's NLL term, in plain torch: the mean of `-log p(token | before)` over every token after the
    first (BOS) of every prompt + chosen sequence, prompt tokens included, all the batch's tokens pooled."""
    total, count = 0.0, 0
    with torch.no_grad():
        for pair in pairs:
            prompt, chosen, _ = encode_pair(tokenizer, pair)
            # every token after the first: a "prompt" of just the first token
            ids = prompt + chosen
            logps = _completion_logps(model, ids[:1], ids[1:])
            total += -logps.sum().item()
            count += logps.numel()
    return total / count


# ---------------------------------------------------------------------------------------------------------------
# (b) TRL's trainers


def _trl_classes(objective: str):
    if objective in ("dpo", "ipo"):
        from trl import DPOConfig, DPOTrainer

        return DPOConfig, DPOTrainer
    with warnings.catch_warnings():  # "You are importing from 'trl.experimental'" (CPO and ORPO live there)
        warnings.simplefilter("ignore")
        if objective == "simpo":
            from trl.experimental.cpo import CPOConfig, CPOTrainer

            return CPOConfig, CPOTrainer
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer

        return ORPOConfig, ORPOTrainer


def _trl_args(objective: str, out_dir: str, batch: int, beta: float, label_smoothing: float, simpo_gamma: float,
              orpo_lambda: float) -> dict:
    common = {"output_dir": out_dir, "per_device_train_batch_size": batch, "use_cpu": True, "bf16": False,
              "fp16": False, "gradient_checkpointing": False, "disable_dropout": True, "report_to": "none",
              "logging_strategy": "no", "save_strategy": "no", "seed": 0, "dataloader_num_workers": 0,
              "remove_unused_columns": False}
    long = 1 << 30  # CPO and ORPO truncate to max_length (None means 512 there)
    if objective == "dpo":
        e = label_smoothing
        if not 0.0 <= e < 0.5:
            raise ValueError(f"label_smoothing must lie in [0, 0.5) for TRL's DPO reference, got {e}")
        # TRL's "sigmoid" ignores label_smoothing (module docstring): (1-e)A + eB from its sigmoid and robust terms
        losses = ({"loss_type": ["sigmoid"]} if e == 0.0 else
                  {"loss_type": ["sigmoid", "robust"], "loss_weights": [2 * (1 - e), -(1 - 2 * e)]})
        return dict(common, beta=beta, label_smoothing=e, max_length=None, precompute_ref_log_probs=False,
                    padding_free=False, use_weighting=False, **losses)
    if objective == "ipo":
        return dict(common, beta=beta, loss_type=["ipo"], max_length=None, precompute_ref_log_probs=False,
                    padding_free=False)
    if objective == "simpo":
        return dict(common, beta=beta, loss_type="simpo", cpo_alpha=0.0, simpo_gamma=simpo_gamma,
                    label_smoothing=0.0, max_length=long)
    return dict(common, beta=orpo_lambda, max_length=long)


def _check_trl_tokens(trainer, tokenizer, pairs, objective: str) -> None:
    """Raise if TRL's tokenized dataset differs from `encode_pair` (the trainer would then score other tokens)."""
    for i, pair in enumerate(pairs):
        prompt, chosen, rejected = encode_pair(tokenizer, pair)
        row = trainer.train_dataset[i]
        if objective in ("dpo", "ipo"):
            got = (row["prompt_ids"], row["chosen_ids"], row["rejected_ids"])
        else:
            got = (row["prompt_input_ids"], row["chosen_input_ids"][len(row["prompt_input_ids"]):],
                   row["rejected_input_ids"][len(row["prompt_input_ids"]):])
            for side, ids in (("chosen", chosen), ("rejected", rejected)):
                labels = row[f"{side}_labels"]
                if labels[:len(prompt)] != [-100] * len(prompt) or labels[len(prompt):] != ids:
                    raise ValueError(f"pair {i}: TRL's {side} labels differ from the definition's")
        if got != (prompt, chosen, rejected):
            raise ValueError(f"pair {i}: TRL tokenized (prompt, chosen, rejected) as {got}, the definition as "
                             f"{(prompt, chosen, rejected)}: a token spans the prompt/completion boundary, or the "
                             "tokenizer does not add BOS (see the module docstring)")


def _load_lora(trainer_model, state: Mapping[str, torch.Tensor], adapter: str) -> dict[str, torch.nn.Parameter]:
    params = lora_parameters(trainer_model, adapter)
    if set(params) != set(state):
        raise ValueError(f"TRL's PEFT model has other LoRA parameters: {sorted(set(params) ^ set(state))[:4]}")
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(state[name])
    return params


def trl_reference(model, tokenizer, pairs: Sequence[Mapping[str, str]], objective: str, beta: float = 0.1,
                  label_smoothing: float = 0.0, simpo_gamma: float = 0.5, orpo_lambda: float = 0.1) -> Reference:
    """The same as `torch_reference`, computed by TRL's trainers (DPOTrainer for "dpo" and "ipo", the
    experimental CPOTrainer with `loss_type="simpo"`, `cpo_alpha=0` for "simpo", ORPOTrainer for "orpo") on one
    batch holding all pairs. For ORPO, `loss`/`grads` are TRL's (its NLL spans differ, see the module docstring)
    and `.stated` holds the definition computed from TRL's pieces."""
    _check_objective(objective)
    from datasets import Dataset
    from datasets.utils.tqdm import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    from peft import get_peft_model_state_dict

    adapter = model.active_adapter
    lora_config = copy.deepcopy(model.peft_config[adapter])
    lora_config.inference_mode = False
    state = {peft_name(k, adapter): v.detach().clone()
             for k, v in get_peft_model_state_dict(model, adapter_name=adapter).items()}
    base = copy.deepcopy(model).unload()  # the base model; TRL's fused LM head patches the model it is given
    tok = copy.deepcopy(tokenizer)
    dataset = Dataset.from_list([{"prompt": p["prompt"], "chosen": p["chosen"], "rejected": p["rejected"]}
                                 for p in pairs])
    config_cls, trainer_cls = _trl_classes(objective)
    bars = not are_progress_bars_disabled()
    disable_progress_bars()  # TRL's dataset maps, 4 rows
    try:
        with tempfile.TemporaryDirectory() as out_dir, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TRL's notes about its defaults (max_length, remove_unused_columns)
            args = config_cls(**_trl_args(objective, out_dir, len(pairs), beta, label_smoothing, simpo_gamma,
                                          orpo_lambda))
            kwargs = {"ref_model": None} if objective in ("dpo", "ipo") else {}
            trainer = trainer_cls(model=base, args=args, train_dataset=dataset, processing_class=tok,
                                  peft_config=lora_config, **kwargs)
    finally:
        if bars:
            enable_progress_bars()
    if "ref" in trainer.model.peft_config:
        raise RuntimeError("TRL made a 'ref' adapter: its reference would not be the adapter disabled")
    params = _load_lora(trainer.model, state, adapter)
    _check_trl_tokens(trainer, tok, pairs, objective)

    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(pairs))])  # in order, one batch
    batch = trainer._prepare_inputs(batch)
    trainer.model.train()  # as in training; every dropout has p=0 (disable_dropout)
    for p in params.values():
        p.grad = None
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    result = Reference(loss=loss.item(), grads={n: p.grad.detach().clone().cpu() for n, p in params.items()})

    if objective == "orpo":
        # The definition from TRL's own pieces: its forward and average logps, its odds-ratio term; only the NLL
        # becomes the mean over pairs of the chosen completion's mean negative log-prob.
        for p in params.values():
            p.grad = None
        chosen_logps, rejected_logps, *_ = trainer.concatenated_forward(trainer.model, batch)
        ratio_losses = trainer.odds_ratio_loss(chosen_logps, rejected_logps)[0]  # lambda log s(log_odds)
        stated = (-chosen_logps).mean() - ratio_losses.mean()
        stated.backward()
        result.stated = Reference(loss=stated.item(),
                                  grads={n: p.grad.detach().clone().cpu() for n, p in params.items()})
    return result
