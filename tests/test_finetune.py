"""LoRA training: what trains, what stays frozen, equality across meshes, exact resume, clean stops."""

import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from conftest import stderr_lines
from isolation import quick_compile_env
from finetune.cli import main
from finetune.config import TrainConfig
from finetune.data.order import row_indices
from finetune.run.reading import load_run, read_run_config
from finetune.train.build import setup
from finetune.step.train_step import loss_and_grads, split_model
from finetune.train.loop import global_batch, run_training
from jaxmodel import load_pretrained
from jaxmodel.lora import apply_lora


def addition_rows(n=48, seed=0):
    rng = np.random.default_rng(seed)
    return [{"prompt": f"add {a} + {b} =", "completion": f" {a + b}"} for a, b in rng.integers(0, 40, (n, 2))]


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in addition_rows()))
    return path


def config(tiny_converted, data_file, out, **kw) -> TrainConfig:
    values = {"model": str(tiny_converted), "data": str(data_file), "out": str(out), "mesh": "dp=1,fsdp=-1,mp=1",
              "steps": 6, "batch_size": 8, "seq_len": 32, "dtype": "float32", "lr": 3e-3, "progress": False,
              "checkpoint_every": 100}
    values.update(kw)
    return TrainConfig(**values).validate()


def flat(state) -> dict[str, np.ndarray]:
    return {".".join(map(str, k)): np.asarray(jax.device_get(v[...])) for k, v in nnx.to_flat_state(state)}


@pytest.mark.slow
def test_only_lora_trains_and_the_loss_falls(tmp_path, tiny_converted, data_file):
    run = setup(config(tiny_converted, data_file, tmp_path / "run", steps=30, lr=1e-2, schedule="constant"))
    base_before = flat(run.base)
    lora_before = flat(run.state.lora)
    assert all(k.endswith(("lora_a", "lora_b")) for k in lora_before) and len(lora_before) == 14
    assert all(not np.any(v) for k, v in lora_before.items() if k.endswith("lora_b"))  # B starts at zero
    state, losses = run.state, []
    with jax.set_mesh(run.mesh):
        for g in range(30):
            batch = global_batch(run.train_rows, lambda lo, hi, g=g: row_indices(len(run.train_rows), 0, g % 2, 8,
                                                                                    lo, hi), run.batch_sharding, 8)
            state, metrics = run.train_step(state, run.base, batch)
            losses.append(float(metrics["loss"]))
    assert losses[-1] < 0.2 * losses[0]  # memorising two batches
    for name, value in flat(run.base).items():
        np.testing.assert_array_equal(value, base_before[name], err_msg=name)  # bit-identical
    assert all(not np.array_equal(v, lora_before[k]) for k, v in flat(state.lora).items())
    # optimizer state covers LoRA parameters only
    opt_leaves = jax.tree.leaves(state.opt_state)
    assert sum(x.size for x in opt_leaves) <= 2 * sum(v.size for v in lora_before.values()) + 10


# Two adapters per layer and no rematerialisation halve the train step's compile time (CPU); tests that
# use them check what a run logs or resumes, which does not depend on either.
FAST_COMPILE = {"targets": "q_proj,v_proj", "remat": "none"}


class TickingClock:
    """`time.perf_counter` advancing exactly `tick` seconds per call: each train step then lasts one tick."""

    def __init__(self, tick: float):
        self.tick, self.now = tick, 0.0

    def perf_counter(self) -> float:
        self.now += self.tick
        return self.now


def hand_flops_per_token(c: dict, seq_len: int) -> float:
    """A LoRA step's model FLOPs per token for HF config `c`, written out: 4N + 12·L·T·H, N the matmul
    weights (q, k, v, o, gate, up, down per layer, and the LM head), H = heads·head_dim."""
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    per_layer = c["hidden_size"] * (2 * q + 2 * kv) + 3 * c["hidden_size"] * c["intermediate_size"]
    n = c["num_hidden_layers"] * per_layer + c["hidden_size"] * c["vocab_size"]
    return 4 * n + 12 * c["num_hidden_layers"] * seq_len * q


def test_the_bf16_peak_is_timed_on_bf16_operands_accumulated_in_float32():
    import jax.numpy as jnp

    from finetune.train.metrics import peak_matmul

    x = jnp.ones((16, 16), jnp.bfloat16)
    dots = [line for line in peak_matmul(jnp.bfloat16).lower(x).as_text().splitlines() if "dot_general" in line]
    # one dot, of the bf16 operands themselves (no float32 copies), with a float32 result
    assert len(dots) == 1 and "(tensor<16x16xbf16>, tensor<16x16xbf16>) -> tensor<16x16xf32>" in dots[0], dots


def test_the_peak_is_timed_on_varied_operands_and_samples_long_enough_to_hide_dispatch(monkeypatch):
    """Constant operands let a power-limited accelerator clock higher than real data does, and one short call a
    sample times its dispatch: the peak times random operands, several calls a sample when one is short."""
    import types

    import jax.numpy as jnp

    from finetune.train import metrics

    clock, seen = [0.0], []

    def matmul_of_2_ms(dtype):  # on a clock of its own: each call takes 2 ms
        def run(x):
            seen.append(np.asarray(x))
            clock[0] += 0.002
            return x
        return run

    monkeypatch.setattr(metrics, "peak_matmul", matmul_of_2_ms)
    monkeypatch.setattr(metrics, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    flops = metrics.measure_peak_flops(jnp.float32, 64, repeats=3)
    assert np.std(seen[0]) > 0.5  # not jnp.ones
    per_sample = (len(seen) - 2) / 2  # after the compiling call and a first sample of one call
    assert per_sample == math.ceil(metrics.TIMED_SAMPLE_SECONDS / 0.002)
    assert flops == pytest.approx(2 * 64**3 / 0.002)


def test_a_short_call_is_timed_several_calls_a_sample(monkeypatch):
    """The sampler behind the matmul peak and the device report's collectives: the first sample is one call, and
    a call shorter than TIMED_SAMPLE_SECONDS is then issued back to back until a sample lasts that long, so that
    dispatching and waiting stay a small part of it; each figure is the sample's seconds per call."""
    import types

    from finetune.train import metrics

    clock, per_sample, issued = [0.0], [], [0]

    def call_of_3_ms():
        clock[0] += 0.003
        issued[0] += 1
        return np.zeros(1)

    def wait(results):  # the waits, in calls a sample
        per_sample.append(len(results))
        return results

    monkeypatch.setattr(metrics, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(metrics.jax, "block_until_ready", wait)
    seconds = metrics.seconds_per_call(call_of_3_ms, 3)
    assert seconds == pytest.approx([0.003] * 3)
    calls = math.ceil(metrics.TIMED_SAMPLE_SECONDS / 0.003)
    assert calls > 1 and per_sample == [1, calls, calls] and issued[0] == sum(per_sample)


def independent_eval_loss(tiny_converted, run_dir: Path, steps: tuple[int, ...], rows, seq_len: int) -> list[float]:
    """Per checkpointed step of the run: the mean completion-token cross-entropy of prompt/completion `rows`,
    each alone in a right-padded row, with that step's LoRA on the converted model; float64 log-softmax of
    the logits in numpy."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_converted)

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    documents = []
    for row in rows:
        prompt = [tokenizer.bos_token_id] + encode(row["prompt"])
        completion = encode(row["completion"]) + [tokenizer.eos_token_id]
        documents.append((prompt + completion, range(len(prompt), len(prompt) + len(completion))))
    ids_bt = np.full((len(rows), seq_len), tokenizer.pad_token_id, np.int32)
    for i, (ids, _) in enumerate(documents):
        ids_bt[i, :len(ids)] = ids
    lora_config = read_run_config(run_dir).lora_config()
    graphdef, _, base = split_model(apply_lora(load_pretrained(tiny_converted), lora_config, rngs=nnx.Rngs(0)))
    forward = jax.jit(lambda lora, ids: nnx.merge(graphdef, lora, base)(ids))
    losses = []
    for step in steps:
        lora, _, _ = load_run(run_dir, step)
        logits_btv = np.asarray(forward(lora, ids_bt), np.float64)
        shifted = logits_btv - logits_btv.max(-1, keepdims=True)
        log_probs_btv = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
        losses.append(float(np.mean([-log_probs_btv[i, j - 1, ids[j]]
                                     for i, (ids, targets) in enumerate(documents) for j in targets])))
    return losses


@pytest.mark.slow
def test_metrics_eval_loss_and_tensorboard(tmp_path, tiny_converted, data_file, monkeypatch):
    """Each record's tokens/s is the step's tokens over its time (one clock tick here), its MFU the model
    FLOPs counted by hand over the peak (fixed here), and each eval loss that of the held-out rows
    evaluated independently with the LoRA checkpointed at the same step."""
    import finetune.train.loop

    peak_per_device, tick = 1e9, 0.25
    monkeypatch.setattr(finetune.train.loop, "measure_peak_flops", lambda dtype: peak_per_device)
    monkeypatch.setattr(finetune.train.loop, "time", TickingClock(tick))
    out = tmp_path / "run"
    summary = run_training(config(tiny_converted, data_file, out, steps=4, eval_fraction=0.25, eval_every=2,
                                  checkpoint_every=2, **FAST_COMPILE))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    tokens_per_step = 8 * 32
    flops = hand_flops_per_token(json.loads((tiny_converted / "config.json").read_text()), 32)
    expected_mfu = flops * tokens_per_step / tick / (peak_per_device * jax.device_count())
    for r in records:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "target_tokens"} <= r.keys()
        assert "peak_memory_gb" not in r  # the CPU backend reports no device memory
        assert r["tokens_per_s"] == tokens_per_step / tick
        assert r["mfu"] == pytest.approx(expected_mfu, rel=1e-12)
    assert [("eval_loss" in r) for r in records] == [False, True, False, True]
    # --eval-fraction 0.25 holds out the first quarter of a permutation seeded with --seed
    held_out = [addition_rows()[i] for i in sorted(np.random.default_rng(0).permutation(48)[:12])]
    expected = independent_eval_loss(tiny_converted, out, (2, 4), held_out, 32)
    assert [records[1]["eval_loss"], records[3]["eval_loss"]] == pytest.approx(expected, rel=1e-5)
    assert abs(expected[1] - expected[0]) > 1e-3 * expected[0]  # so a loss of the wrong step would not pass
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert str(summary).startswith("trained 4 steps, loss ") and "peak device memory" not in str(summary)


@pytest.mark.slow
def test_a_mesh_smaller_than_the_devices_trains_on_the_first_ones(tmp_path, tiny_converted, data_file, capsys,
                                                                   monkeypatch):
    """A 2-device mesh on 8 devices: the run says once that it leaves 6 unused, and its MFU is over the peak of
    the 2 devices it uses."""
    import finetune.train.loop
    from finetune.step import mesh as mesh_module

    mesh_module._note_unused_devices.cache_clear()  # printed once per process
    peak_per_device, tick = 1e9, 0.25
    monkeypatch.setattr(finetune.train.loop, "measure_peak_flops", lambda dtype: peak_per_device)
    monkeypatch.setattr(finetune.train.loop, "time", TickingClock(tick))
    out = tmp_path / "run"
    summary = run_training(config(tiny_converted, data_file, out, mesh="dp=1,fsdp=2,mp=1", steps=2, **FAST_COMPILE))
    assert summary.steps == 2
    assert stderr_lines(capsys.readouterr().err) == [
        ("finetune-lora: note: the mesh uses 2 of the 8 visible devices; HIP_VISIBLE_DEVICES (ROCm) or "
         "CUDA_VISIBLE_DEVICES (CUDA) chooses which are visible (JAX reserves memory on every visible GPU, used or not)")]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    flops = hand_flops_per_token(json.loads((tiny_converted / "config.json").read_text()), 32)
    assert [r["mfu"] for r in records] == pytest.approx([flops * 8 * 32 / tick / (peak_per_device * 2)] * 2,
                                                        rel=1e-12)


class FakeDevice:
    """A device whose `memory_stats()` says what a backend would: None (CPU) or a dict of counters."""

    def __init__(self, stats: dict | None):
        self.stats = stats

    def memory_stats(self) -> dict | None:
        return self.stats


@pytest.mark.slow
def test_logged_steps_and_summary_record_peak_device_memory(tmp_path, tiny_converted, data_file, monkeypatch):
    """Each logged step's record holds the largest peak of the run's devices (those that report one), read as
    the step is logged; the summary the peak at the end."""
    import finetune.train.loop
    from finetune.train.metrics import peak_memory_gb

    skip_peak_measurement(monkeypatch)
    reads = []

    def growing_peaks(devices):  # the run's devices stand in for fakes whose peak grows with each read
        reads.append(list(devices))
        return peak_memory_gb([FakeDevice(None), FakeDevice({"bytes_in_use": 9e9}),
                               FakeDevice({"peak_bytes_in_use": 2.5e9 * len(reads)}),
                               FakeDevice({"peak_bytes_in_use": 1e9})])

    monkeypatch.setattr(finetune.train.loop, "peak_memory_gb", growing_peaks)
    out = tmp_path / "run"
    summary = run_training(config(tiny_converted, data_file, out, steps=3, log_every=2, **FAST_COMPILE))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["peak_memory_gb"]) for r in records] == [(2, 2.5), (3, 5.0)]  # logged steps only
    assert reads == [jax.devices()] * 3
    assert str(summary).endswith(", peak device memory 7.5 GB")


@pytest.mark.slow
def test_training_with_lora_dropout(tmp_path, tiny_converted, data_file):
    summary = run_training(config(tiny_converted, data_file, tmp_path / "run", steps=12, lr=1e-2, lora_dropout=0.1,
                           schedule="constant"))
    assert summary.steps == 12 and summary.last_loss < 0.7 * summary.first_loss


def grads_on(tiny_converted, data_file, tmp_path, mesh: str, devices, grad_accum=1):
    run = setup(config(tiny_converted, data_file, tmp_path / "run", mesh=mesh, grad_accum=grad_accum), devices=devices)
    # LoRA B made non-zero so that gradients reach A too
    lora = jax.tree.map(lambda x: x + 0.01 * jax.random.normal(jax.random.key(1), x.shape, x.dtype), run.state.lora)
    with jax.set_mesh(run.mesh):
        batch = global_batch(run.train_rows, lambda lo, hi: row_indices(len(run.train_rows), 0, 0, 8, lo, hi),
                              run.batch_sharding, 8)
        fn = jax.jit(lambda lora, base, batch: loss_and_grads(run.graphdef, lora, base, batch, grad_accum))
        loss, tokens, grads = fn(lora, run.base, batch)
    return float(loss), float(tokens), flat(grads)


@pytest.fixture(scope="module")
def reference_grads(tiny_converted, data_file, tmp_path_factory):
    return grads_on(tiny_converted, data_file, tmp_path_factory.mktemp("ref"), "dp=1,fsdp=1,mp=1", jax.devices()[:1])


@pytest.mark.parametrize("mesh, accum", [("dp=1,fsdp=8,mp=1", 1), ("dp=2,fsdp=4,mp=1", 1), ("dp=2,fsdp=2,mp=2", 1),
                                         ("dp=1,fsdp=4,mp=2", 2)])
@pytest.mark.slow
def test_same_loss_and_grads_on_every_mesh(tmp_path, tiny_converted, data_file, reference_grads, mesh, accum):
    loss, tokens, grads = grads_on(tiny_converted, data_file, tmp_path, mesh, jax.devices(), grad_accum=accum)
    ref_loss, ref_tokens, ref_grads = reference_grads
    assert tokens == ref_tokens and abs(loss - ref_loss) <= 1e-5
    for name, g in grads.items():
        np.testing.assert_allclose(g, ref_grads[name], atol=1e-5, rtol=0, err_msg=name)


def test_lora_state_is_sharded_like_its_base_weight(tmp_path, tiny_converted, data_file):
    run = setup(config(tiny_converted, data_file, tmp_path / "run", mesh="dp=1,fsdp=4,mp=2"))
    attn = run.model.layers.self_attn
    assert attn.q_proj.weight[...].sharding.spec == P(None, "mp", "fsdp")
    assert run.state.lora["layers"]["self_attn"]["q_proj"]["lora_a"][...].sharding.spec == P(None, "fsdp", None)
    # B's output axis follows the weight's (mp); its rank axis carries the fsdp split
    assert run.state.lora["layers"]["self_attn"]["q_proj"]["lora_b"][...].sharding.spec == P(None, "fsdp", "mp")
    mu = run.state.opt_state[1][0].mu["layers"]["self_attn"]["q_proj"]["lora_a"][...]
    assert mu.sharding.spec == P(None, "fsdp", None)


# Dropout and gradient accumulation on: a resume must restore the dropout key stream, not only the
# parameters, optimizer state and data position. fsdp=4 so that each micro-batch of 4 rows splits evenly.
RESUMED = {"steps": 4, "lora_dropout": 0.1, "grad_accum": 2, "mesh": "dp=1,fsdp=4,mp=2", **FAST_COMPILE}


def skip_peak_measurement(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fixed peak FLOP/s instead of seconds of timed matmuls per run, where MFU is not under test."""
    import finetune.train.loop

    monkeypatch.setattr(finetune.train.loop, "measure_peak_flops", lambda dtype: 1e12)


@pytest.fixture(scope="module")
def uninterrupted(tiny_converted, data_file, tmp_path_factory):
    """The run directory of an uninterrupted RESUMED run."""
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    with pytest.MonkeyPatch.context() as monkeypatch:
        skip_peak_measurement(monkeypatch)
        run_training(config(tiny_converted, data_file, out, **RESUMED))
    return out


def assert_same_run(expected: Path, got: Path) -> None:
    """Bit-identical loss at every step and final LoRA arrays."""
    a = [json.loads(line) for line in (expected / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(line) for line in (got / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert [r["loss"] for r in a] == [r["loss"] for r in b]  # bit for bit
    (lora_a, _, step_a), (lora_b, _, step_b) = load_run(expected), load_run(got)
    assert step_a == step_b == 4
    for name, value in flat(lora_a).items():
        np.testing.assert_array_equal(value, flat(lora_b)[name], err_msg=name)


@pytest.mark.slow
def test_resume_with_dropout_and_accumulation_continues_exactly(tmp_path, tiny_converted, data_file, uninterrupted,
                                                               monkeypatch):
    """Two steps, a checkpoint, then `resume=True` for the other two: the same run bit for bit."""
    skip_peak_measurement(monkeypatch)
    resumed = tmp_path / "resumed"
    run_training(config(tiny_converted, data_file, resumed, stop_after=2, **RESUMED))
    run_training(config(tiny_converted, data_file, resumed, resume=True, **RESUMED))
    assert_same_run(uninterrupted, resumed)


@pytest.mark.slow
def test_cli_resume_from_a_yaml_config_continues_exactly(tmp_path, tiny_converted, data_file, uninterrupted, capsys,
                                                        monkeypatch):
    """`finetune-lora --config run.yaml --stop-after 2`, then `--config run.yaml --resume`: the same run bit
    for bit as the uninterrupted one started from Python with the same options."""
    import yaml

    skip_peak_measurement(monkeypatch)
    resumed = tmp_path / "resumed"
    options = {"model": str(tiny_converted), "data": str(data_file), "out": str(resumed), "batch-size": 8,
               "seq-len": 32, "dtype": "float32", "lr": 3e-3, "progress": False, "checkpoint-every": 100,
               **{k.replace("_", "-"): v for k, v in RESUMED.items()}}
    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text(yaml.safe_dump(options))
    assert main(["--config", str(run_yaml), "--stop-after", "2"]) == 0
    assert capsys.readouterr().out.startswith("trained 2 steps")
    assert main(["--config", str(run_yaml), "--resume"]) == 0
    assert capsys.readouterr().out.startswith("trained 2 steps")
    assert_same_run(uninterrupted, resumed)


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path, tiny_converted, data_file):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "finetune.cli", "--model", str(tiny_converted), "--data", str(data_file), "--out",
           str(out), "--steps", "100000", "--batch-size", "8", "--seq-len", "32", "--dtype", "float32",
           "--no-progress", "--checkpoint-every", "100000"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=quick_compile_env())
    deadline = time.time() + 240
    while time.time() < deadline and not ((out / "metrics.jsonl").exists() and
                                          len((out / "metrics.jsonl").read_text().splitlines()) >= 3):
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    assert "stopped by SIGTERM after" in stdout
    steps_done = len((out / "metrics.jsonl").read_text().splitlines())
    saved = sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())
    assert saved == [steps_done]


@pytest.mark.slow
def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, tiny_converted, data_file, capsys):
    code = main(["--model", str(tiny_converted), "--data", str(data_file), "--out", str(tmp_path / "run"),
                 "--steps", "20", "--batch-size", "8", "--seq-len", "32", "--dtype", "float32", "--lr", "1e30",
                 "--clip-norm", "0", "--checkpoint-every", "1", "--no-progress"])
    err = stderr_lines(capsys.readouterr().err)
    assert code == 1 and len(err) == 1
    assert "non-finite loss or gradient at step" in err[0] and "newest checkpoint kept: step" in err[0]
    bad_step = int(err[0].split("at step ")[1].split()[0])
    saved = sorted(int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit())
    assert saved and max(saved) == bad_step - 1


@pytest.mark.parametrize("args, message", [
    (["--mesh", "dp=16,fsdp=1,mp=1"],
     "--mesh 'dp=16,fsdp=1,mp=1': dp x fsdp x cp x mp = 16x1x1x1 = 16 devices, but 8 are available"),
    (["--rank", "0"], "--rank must be a positive integer, got 0"),
    (["--seq-len", "4096"], "--seq-len 4096 exceeds the model's max_position_embeddings (1024)"),
    (["--targets", "q_proj,attn"], "LoRA targets ['attn']"),
    (["--batch-size", "6"], "--batch-size 6 / --grad-accum 1 must be a multiple of dp x fsdp = 8"),
])
def test_bad_options_are_one_line_errors(tmp_path, tiny_converted, data_file, capsys, args, message):
    base = ["--model", str(tiny_converted), "--data", str(data_file), "--out", str(tmp_path / "run"), "--steps", "1",
            "--seq-len", "32", "--batch-size", "8", "--no-progress"]
    code = main(base + args)
    err = stderr_lines(capsys.readouterr().err)
    assert code != 0 and len(err) == 1 and message in err[0], err


def test_bad_inputs_are_one_line_errors(tmp_path, tiny_checkpoint, tiny_converted, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "fine"}\n{"text": \n')
    missing = tmp_path / "missing.jsonl"
    missing.write_text('{"text": "fine"}\n{"answer": "x"}\n')
    cases = [
        (["--model", str(tiny_converted), "--data", str(empty)], f"{empty}: no rows"),
        (["--model", str(tiny_converted), "--data", str(broken)], f"{broken}:2: not valid JSON"),
        (["--model", str(tiny_converted), "--data", str(missing)], f"{missing}:2: layout text expects a 'text' string"),
        (["--model", str(tiny_checkpoint), "--data", str(missing)], "not a converted checkpoint"),
    ]
    for args, message in cases:
        code = main(args + ["--out", str(tmp_path / "run"), "--steps", "1", "--seq-len", "32", "--batch-size", "8",
                            "--no-progress"])
        err = stderr_lines(capsys.readouterr().err)
        assert code != 0 and len(err) == 1 and message in err[0], (args, err)


def test_yaml_config_with_flags_overriding(tmp_path, tiny_converted, data_file):
    from finetune.config import load_config

    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text(f"model: {tiny_converted}\ndata: {data_file}\nout: {tmp_path}\nrank: 4\nlr: 0.001\n"
                         "targets: [q_proj, v_proj]\nseq-len: 64\n")
    cfg = load_config(["--config", str(yaml_file), "--rank", "16"], "finetune-lora", "")
    assert (cfg.rank, cfg.lr, cfg.seq_len, cfg.target_modules) == (16, 0.001, 64, ("q_proj", "v_proj"))
    yaml_file.write_text("rnak: 4\n")
    from finetune.config import ConfigFileError

    with pytest.raises(ConfigFileError, match="unknown option 'rnak'"):
        load_config(["--config", str(yaml_file)], "finetune-lora", "")


def test_help_documents_every_option_and_default(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    for flag in ("--mesh", "--steps", "--batch-size", "--seq-len", "--lr", "--rank", "--alpha", "--targets", "--seed",
                 "--resume", "--config", "--plan", "--hbm-gb", "--show-sharding"):
        assert flag in text
    assert "(default: dp=1,fsdp=-1,mp=1)" in text and "(default: 8)" in text


@pytest.mark.e2e
def test_two_processes_over_loopback_match_one_device(two_process_grads, data_file, reference_grads):
    assert (two_process_grads / "sft.jsonl").read_bytes() == data_file.read_bytes()
    got = np.load(two_process_grads / "sft.npz")
    ref_loss, ref_tokens, ref_grads = reference_grads
    assert float(got["tokens"]) == ref_tokens and abs(float(got["loss"]) - ref_loss) <= 1e-5
    for name, g in ref_grads.items():
        np.testing.assert_allclose(got[name], g, atol=1e-5, rtol=0, err_msg=name)


@pytest.mark.slow
def test_training_needs_neither_torch_nor_peft(tiny_converted, data_file, tmp_path):
    """finetune-lora runs in a rocm/jax container without torch (the [train] extra has none)."""
    from isolation import run_without

    result = run_without(("torch", "peft"), (
        "from finetune.cli import main\n"
        f"rc = main(['--model', {str(tiny_converted)!r}, '--data', {str(data_file)!r}, '--out', "
        f"{str(tmp_path / 'run')!r}, '--steps', '2', '--batch-size', '8', '--seq-len', '32', '--no-progress'])\n"
        "assert not [m for m in sys.modules if m.split('.')[0] in BLOCKED], 'torch or peft was imported'\n"
        "sys.exit(rc)\n"
    ))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "trained 2 steps" in result.stdout
