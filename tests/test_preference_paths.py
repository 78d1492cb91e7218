"""Preference objectives on the toolkit's other paths: the chunked LM head of long sequences, a quantized base,
two processes, and export-peft of a preference run."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from finetune.step.preference import token_logps
from finetune.train.batches import pair_batch
from finetune.train.build import setup
from finetune.train.loop import run_training
from jaxmodel.layers import LoRAParam
from test_preference_training import addition_pairs, config, step_on


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in addition_pairs()))
    return path


@pytest.mark.slow
def test_chunked_lm_head_gives_the_plain_token_logps_and_their_lora_gradients(tmp_path, tiny_converted, pairs_file,
                                                                              monkeypatch):
    """The frozen head's chunks (the tiny model has no LoRA on lm_head): the log-probabilities, and the LoRA
    gradient of a weighted sum of them (weights of either sign, as DPO's), equal the plain head's."""
    import finetune.step.lm_head as lm_head

    calls = []
    frozen = lm_head.frozen_head_token_losses
    monkeypatch.setattr(lm_head, "frozen_head_token_losses", lambda *a, **k: calls.append(k) or frozen(*a, **k))
    run = setup(config(tiny_converted, pairs_file, tmp_path / "run", pack=True))
    graphdef, lora, base = nnx.split(run.model, LoRAParam, ...)
    lora = jax.tree.map(lambda x: x + 0.01 * jax.random.normal(jax.random.key(1), x.shape, x.dtype), lora)
    with jax.set_mesh(run.mesh):
        batch = pair_batch(run.train_rows, run.batch_sharding, 0)
        weights = jnp.asarray(np.random.default_rng(0).normal(size=batch["loss_mask"].shape), jnp.float32)

        def logps(lora, chunk):
            return token_logps(nnx.merge(graphdef, base, lora), batch, chunk=chunk)[0]

        def weighted_sum(lora, chunk):
            return jnp.sum(jnp.where(batch["loss_mask"] > 0, logps(lora, chunk) * weights, 0.0))

        plain, chunked = (jax.jit(logps, static_argnums=1)(lora, chunk) for chunk in (0, 7))  # 7: a ragged last chunk
        grads = [jax.jit(jax.grad(weighted_sum), static_argnums=1)(lora, chunk) for chunk in (0, 7)]
    assert [k["chunk"] for k in calls] == [7, 7]
    mask = np.asarray(batch["loss_mask"]) > 0
    assert mask.sum() > 16
    np.testing.assert_allclose(np.asarray(chunked)[mask], np.asarray(plain)[mask], rtol=1e-6, atol=1e-6)
    for (name, want), (_, got) in zip(nnx.to_flat_state(grads[0]), nnx.to_flat_state(grads[1])):
        scale = float(jnp.max(jnp.abs(want[...])))
        assert scale > 0, name
        np.testing.assert_allclose(np.asarray(got[...]), np.asarray(want[...]), rtol=0, atol=1e-5 * scale,
                                   err_msg=str(name))


@pytest.fixture(scope="module")
def nf4_converted(tiny_checkpoint, tmp_path_factory):
    from converter.conversion import convert

    out = tmp_path_factory.mktemp("nf4") / "tiny-nf4"
    convert(tiny_checkpoint, out, quantize="nf4", progress=False)
    return out


@pytest.mark.slow
def test_dpo_on_a_quantized_base_starts_at_ln2_and_learns(tmp_path, nf4_converted, pairs_file, monkeypatch):
    import finetune.train.loop

    monkeypatch.setattr(finetune.train.loop, "measure_peak_flops", lambda dtype: 1e12)
    out = tmp_path / "run"
    run_training(config(nf4_converted, pairs_file, out, steps=6, lr=1e-2))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["loss"] == pytest.approx(np.log(2.0), rel=1e-6)
    assert records[-1]["loss"] < records[0]["loss"]


@pytest.mark.e2e
@pytest.mark.parametrize("objective", ["dpo", "dpo-precomputed"])  # the reference in the step, or computed before
def test_two_processes_give_the_one_device_loss_and_gradients(tmp_path, tiny_converted, pairs_file, two_process_grads,
                                                             objective):
    assert (two_process_grads / "pairs.jsonl").read_bytes() == pairs_file.read_bytes()
    loss, metrics, grads, _ = step_on(tiny_converted, pairs_file, tmp_path / "one", "dp=1,fsdp=1,mp=1",
                                      jax.devices()[:1], pack=True)
    got = np.load(two_process_grads / f"{objective}.npz")
    assert float(got["pairs"]) == metrics["pairs"] and float(got["loss"]) == pytest.approx(loss, rel=1e-5)
    for name, g in grads.items():
        assert np.linalg.norm(got[name] - g) <= 1e-5 * np.linalg.norm(g), name


@pytest.mark.slow
def test_export_of_a_dpo_run_is_an_ordinary_peft_adapter(tmp_path, tiny_converted, pairs_file, monkeypatch):
    import finetune.train.loop
    from export.adapter import export_adapter
    from jaxmodel.formats.peft_adapter import read_adapter

    monkeypatch.setattr(finetune.train.loop, "measure_peak_flops", lambda dtype: 1e12)
    run_dir = tmp_path / "run"
    run_training(config(tiny_converted, pairs_file, run_dir, steps=2))
    export_adapter(run_dir, tmp_path / "adapter", base_model="tiny")
    lora_config, tensors = read_adapter(tmp_path / "adapter")
    assert lora_config.rank == 8 and set(lora_config.targets) == {"q_proj", "v_proj"}
    assert any(np.any(v) for k, v in tensors.items() if "lora_B" in k)  # trained


@pytest.mark.slow
@pytest.mark.parametrize("objective, reference", [("dpo", "base"), ("orpo", "none")])
def test_plan_compiles_the_preference_step(tmp_path, objective, reference):
    from finetune.config import TrainConfig
    from finetune.planning.plan import plan

    config = {"model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "torch_dtype": "float32"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    sft = plan(TrainConfig(plan=True, model_config=str(tmp_path / "config.json"), mesh="dp=1,fsdp=8,mp=1",
                           batch_size=16, seq_len=32, hbm_gb=1).validate(), cpu_bf16_figure=False)
    report = plan(TrainConfig(plan=True, model_config=str(tmp_path / "config.json"), mesh="dp=1,fsdp=8,mp=1",
                              batch_size=8, seq_len=32, hbm_gb=1, objective=objective).validate(),
                  cpu_bf16_figure=False)
    assert f"objective {objective}: 8 pairs in 16 rows a step" in str(report) and f"reference {reference}" in str(report)
    assert report.batch > sft.batch  # the same rows, and each token's sequence slot


@pytest.mark.parametrize("remat", ["none", "full"])
@pytest.mark.slow
def test_a_dpo_step_gathers_the_frozen_head_weight_once_for_the_policy_and_the_reference(tmp_path, remat):
    """Split over fsdp=8, the head weight is all-gathered whole once a step: the policy's and the reference's frozen
    head losses (and a recomputation under remat) share that gather rather than each gathering it in its chunks
    (there the weight is `[vocab, hidden]` as well: three such gathers, the embedding table's included)."""
    from finetune.config import TrainConfig
    from finetune.planning.plan import _compile
    from finetune.step.mesh import make_mesh
    from jaxmodel.config import ModelConfig

    vocab, hidden = 512, 64
    hf = {"model_type": "llama", "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "torch_dtype": "float32"}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    cfg = TrainConfig(plan=True, model_config=str(tmp_path / "config.json"), mesh="dp=1,fsdp=8,mp=1", seq_len=64,
                      loss_chunk=16, batch_size=8, objective="dpo", remat=remat, hbm_gb=1, dtype="float32").validate()
    compiled, _ = _compile(cfg, ModelConfig.from_hf(tmp_path), make_mesh(cfg.mesh, jax.devices()), np.float32,
                           np.float32)
    gathers = re.findall(r"= f32\[([\d,]*)\][^ ]* all-gather(?:-start)?\(", compiled.as_text())
    # the embedding table's gather (whole along the hidden dimension for its lookup) and the head weight's
    assert gathers.count(f"{vocab},{hidden}") == 2, gathers
