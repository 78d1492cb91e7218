"""Preference training end to end: equal losses and gradients on every mesh and packed or not, the TRL metric
names in metrics.jsonl (eval too), exact resume, a frozen initial-adapter reference, and one-line errors for
data that does not match the objective."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from conftest import stderr_lines
from finetune.cli import main
from finetune.config import TrainConfig
from finetune.run.reading import load_run
from finetune.step.preference import Objective
from finetune.step.train_step import preference_loss_and_grads
from finetune.train.batches import pair_batch
from finetune.train.build import setup
from finetune.train.loop import run_training
from jaxmodel.formats.peft_adapter import save_peft_adapter


def addition_pairs(n=24, seed=0):
    """The right sum is chosen, a wrong one rejected; prompts and completions of several lengths."""
    rng = np.random.default_rng(seed)
    rows = []
    for a, b, wrong in rng.integers(0, 40, (n, 3)):
        pad = " please" * int(rng.integers(0, 3))
        rows.append({"prompt": f"add {a} + {b}{pad} =", "chosen": f" {a + b}",
                     "rejected": f" {a + b + 1 + wrong} or so" if wrong % 2 else f" {wrong}"})
    return rows


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in addition_pairs()))
    return path


def config(tiny_converted, data, out, **kw) -> TrainConfig:
    values = {"model": str(tiny_converted), "data": str(data), "out": str(out), "mesh": "dp=1,fsdp=-1,mp=1",
              "objective": "dpo", "steps": 4, "batch_size": 8, "seq_len": 32, "dtype": "float32", "lr": 3e-3,
              "progress": False, "checkpoint_every": 100, "targets": "q_proj,v_proj", "remat": "none"}
    values.update(kw)
    return TrainConfig(**values).validate()


def flat(state) -> dict[str, np.ndarray]:
    return {".".join(map(str, k)): np.asarray(jax.device_get(v[...])) for k, v in nnx.to_flat_state(state)}


def buffers(state) -> set[int]:
    """The addresses of the device buffers (every shard) of a state's arrays."""
    return {shard.data.unsafe_buffer_pointer() for _, v in nnx.to_flat_state(state)
            for shard in v[...].addressable_shards}


def step_on(tiny_converted, data, tmp_path, mesh: str, devices, **kw):
    """(loss, metrics, LoRA gradients) of step 0's pairs with adapters whose B is non-zero."""
    cfg = config(tiny_converted, data, tmp_path / "run", mesh=mesh, **kw)
    run = setup(cfg, devices=devices)
    lora = jax.tree.map(lambda x: x + 0.01 * jax.random.normal(jax.random.key(1), x.shape, x.dtype), run.state.lora)
    base, reference = run.frozen
    with jax.set_mesh(run.mesh):
        batch = pair_batch(run.train_rows, run.batch_sharding, 0)
        fn = jax.jit(lambda lora, base, batch: preference_loss_and_grads(
            run.graphdef, lora, base, reference, batch, Objective.of(cfg), cfg.batch_size, cfg.grad_accum,
            loss_chunk=cfg.loss_chunk))
        loss, metrics, grads = fn(lora, base, batch)
    return float(loss), {k: float(v) for k, v in metrics.items()}, flat(grads), run.train_rows.rows_per_step


@pytest.fixture(scope="module")
def one_device(tiny_converted, pairs_file, tmp_path_factory):
    return step_on(tiny_converted, pairs_file, tmp_path_factory.mktemp("one"), "dp=1,fsdp=1,mp=1", jax.devices()[:1],
                   pack=False)


def assert_same_step(got, expected, rtol=1e-5):
    loss, metrics, grads, _ = got
    ref_loss, ref_metrics, ref_grads, _ = expected
    assert metrics["pairs"] == ref_metrics["pairs"] == 8 and metrics["tokens"] == ref_metrics["tokens"]
    assert loss == pytest.approx(ref_loss, rel=rtol)
    for name, g in grads.items():
        assert np.linalg.norm(g - ref_grads[name]) <= rtol * np.linalg.norm(ref_grads[name]), name


@pytest.mark.slow
@pytest.mark.parametrize("mesh, kw", [("dp=1,fsdp=8,mp=1", {}), ("dp=2,fsdp=2,mp=2", {}),
                                      ("dp=1,fsdp=4,mp=2", {"grad_accum": 2}),
                                      ("dp=1,fsdp=2,cp=2,mp=2", {"pack": False})])
def test_same_loss_and_gradients_on_every_mesh(tmp_path, tiny_converted, pairs_file, one_device, mesh, kw):
    assert_same_step(step_on(tiny_converted, pairs_file, tmp_path, mesh, jax.devices(), **kw), one_device)


@pytest.mark.slow
def test_packed_pairs_equal_unpacked_ones_in_fewer_rows(tmp_path, tiny_converted, pairs_file, one_device):
    packed = step_on(tiny_converted, pairs_file, tmp_path, "dp=1,fsdp=1,mp=1", jax.devices()[:1], pack=True)
    assert_same_step(packed, one_device)
    assert one_device[3] == 16 and packed[3] < 16  # two rows a pair unpacked; these short pairs share rows


TRL_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
               "logps/rejected")


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_dpo_run_logs_trl_metrics_evaluates_and_resumes_exactly(tmp_path, tiny_converted, pairs_file, monkeypatch):
    import finetune.train.loop

    monkeypatch.setattr(finetune.train.loop, "measure_peak_flops", lambda dtype: 1e12)
    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text("".join(json.dumps(r) + "\n" for r in addition_pairs(5, seed=1)))
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    run_training(config(tiny_converted, pairs_file, whole, eval_data=str(eval_file)))
    run_training(config(tiny_converted, pairs_file, resumed, eval_data=str(eval_file), stop_after=2))
    run_training(config(tiny_converted, pairs_file, resumed, eval_data=str(eval_file), resume=True))
    a, b = records(whole), records(resumed)
    assert [r["step"] for r in a] == [1, 2, 3, 4, 4]
    first = a[0]
    # B starts at zero and the reference is the base: the policy is the reference at step 1
    assert first["loss"] == pytest.approx(np.log(2.0), rel=1e-6) and first["pairs"] == 8
    assert all(name in first for name in TRL_METRICS) and first["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    assert a[3]["loss"] < first["loss"] and a[3]["rewards/accuracies"] > 0.5
    assert {f"eval_{name}" for name in ("loss", *TRL_METRICS)} <= set(a[4])
    assert [r["loss"] for r in a[:4]] == [r["loss"] for r in b if "loss" in r]  # bit for bit
    # MFU counts the reference's forward too: 4N + 12·L·T·H for the policy, 2N + 4·L·T·H for the reference
    c = json.loads((tiny_converted / "config.json").read_text())
    q = c["num_attention_heads"] * c["head_dim"]
    n = (c["num_hidden_layers"] * c["hidden_size"] * (2 * q + 2 * c["num_key_value_heads"] * c["head_dim"]
                                                       + 3 * c["intermediate_size"]) + c["hidden_size"] * c["vocab_size"])
    attention = c["num_hidden_layers"] * 32 * q
    peak = 1e12 * jax.device_count()
    assert first["mfu"] == pytest.approx(first["tokens_per_s"] * (6 * n + 16 * attention) / peak, rel=1e-9)
    for name, value in flat(load_run(whole)[0]).items():
        np.testing.assert_array_equal(value, flat(load_run(resumed)[0])[name], err_msg=name)


@pytest.mark.slow
def test_the_initial_adapter_reference_is_never_trained(tmp_path, tiny_converted, pairs_file):
    adapter = tmp_path / "adapter"
    run = setup(config(tiny_converted, pairs_file, tmp_path / "first"))
    lora = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(2), x.shape, x.dtype), run.state.lora)
    save_peft_adapter(adapter, lora, run.config.lora_config(), model_config=run.llama, base_model="tiny")
    cfg = config(tiny_converted, pairs_file, tmp_path / "dpo", init_adapter=str(adapter))
    run = setup(cfg)
    base, reference = run.frozen
    assert cfg.reference_model() == "init" and reference is not None
    # a copy: none of its buffers is one of the state's, which each step donates and replaces
    assert not buffers(reference) & buffers(run.state.lora)
    before = flat(reference)
    state = run.state
    with jax.set_mesh(run.mesh):
        for g in range(3):
            state, metrics = run.train_step(state, run.frozen, pair_batch(run.train_rows, run.batch_sharding, g))
    assert float(metrics["rewards/margins"]) != 0.0  # the policy moved away from its reference
    for name, value in flat(reference).items():
        np.testing.assert_array_equal(value, before[name], err_msg=name)  # bit-identical
    assert any(not np.array_equal(v, before[k]) for k, v in flat(state.lora).items())


@pytest.mark.slow
@pytest.mark.parametrize("objective, rows, message", [
    ("dpo", [{"prompt": "add 1 + 2 =", "completion": " 3"}], "--objective dpo trains on chosen/rejected pairs"),
    ("sft", [{"prompt": "add 1 + 2 =", "chosen": " 3", "rejected": " 4"}], "preference"),
    ("dpo", [{"prompt": "add 1 + 2 =", "chosen": " 3"}], "rejected"),
])
def test_data_that_does_not_match_the_objective_is_one_line(tmp_path, tiny_converted, capsys, objective, rows,
                                                            message):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code = main(["--model", str(tiny_converted), "--data", str(data), "--out", str(tmp_path / "run"), "--objective",
                 objective, "--no-progress", "--steps", "1", "--batch-size", "8", "--seq-len", "16"])
    lines = stderr_lines(capsys.readouterr().err)
    assert code == 1 and len(lines) == 1 and "d.jsonl" in lines[0] and message in lines[0], lines
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def finished_dpo_run(tiny_converted, pairs_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("dpo") / "run"
    with pytest.MonkeyPatch.context() as monkeypatch:
        import finetune.train.loop

        monkeypatch.setattr(finetune.train.loop, "measure_peak_flops", lambda dtype: 1e12)
        run_training(config(tiny_converted, pairs_file, out, steps=1))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("flags, change", [
    (["--beta", "0.2"], "--beta: 0.1 -> 0.2"),
    (["--label-smoothing", "0.1"], "--label-smoothing: 0.0 -> 0.1"),
    (["--reference", "base"], "--reference: auto -> base"),
    (["--objective", "ipo"], "--objective: dpo -> ipo"),
    (["--objective", "simpo", "--simpo-gamma", "1"], "--objective: dpo -> simpo, --simpo-gamma: 0.5 -> 1.0"),
    (["--objective", "orpo", "--orpo-lambda", "1"], "--objective: dpo -> orpo, --orpo-lambda: 0.1 -> 1.0"),
])
def test_resume_refuses_a_changed_objective_knob(tiny_converted, pairs_file, finished_dpo_run, capsys, flags, change):
    before = sorted((p.name, p.stat().st_size) for p in finished_dpo_run.rglob("*"))
    args = ["--model", str(tiny_converted), "--data", str(pairs_file), "--out", str(finished_dpo_run), "--objective",
            "dpo", "--steps", "4", "--batch-size", "8", "--seq-len", "32", "--dtype", "float32", "--lr", "3e-3",
            "--no-progress", "--checkpoint-every", "100", "--targets", "q_proj,v_proj", "--remat", "none", "--resume"]
    assert main(args + flags) == 1
    line = stderr_lines(capsys.readouterr().err)[-1]
    assert f"which a resume cannot change: {change} (give them as they were" in line, line
    assert sorted((p.name, p.stat().st_size) for p in finished_dpo_run.rglob("*")) == before
