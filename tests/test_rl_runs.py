"""Online RL runs end to end (finetune-lora --objective grpo and rloo on the tiny Llama): the first step from its own
completions equal on one device, a dp/fsdp/mp mesh and two processes; TRL's metric names, the base's held-out rewards
at step 0 and sampled completions in metrics.jsonl and TensorBoard; a resume between the iterations of a batch of
completions that ends where the uninterrupted run does, bit for bit; PEFT export; one-line errors for bad input."""

import json
import re
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from conftest import stderr_lines, write_jsonl
from finetune.cli import main
from finetune.config import TrainConfig
from finetune.run.reading import load_run
from rl_cases import RL_KNOBS, first_rollout_step, prompt_rows, rl_options, write_rewards


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """(prompts file, rewards file) in a directory of their own."""
    directory = tmp_path_factory.mktemp("rl")
    return write_jsonl(directory / "prompts.jsonl", prompt_rows()), write_rewards(directory)


def flags(options: dict) -> list[str]:
    out = []
    for name, value in options.items():
        flag = f"--{name.replace('_', '-')}"
        if isinstance(value, bool):
            out.append(flag if value else f"--no-{flag[2:]}")
            continue
        for one in (value if isinstance(value, tuple) else (value,)):
            out += [flag, str(one)]
    return out


def cli(model, data, out, rewards_file, *extra: str, **changed) -> list[str]:
    """finetune-lora's arguments for the module's GRPO run (`rl_options`, with `changed` options) and `extra`."""
    return ["--model", str(model), "--data", str(data), "--out", str(out), "--mesh", "dp=1,fsdp=1,mp=1", "--steps",
            "4", "--lr", "1e-2", "--no-progress", "--checkpoint-every", "100", "--eval-fraction", "0.2",
            "--eval-generate", "2", *flags(rl_options(rewards_file) | changed), *extra]


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def timeless(record: dict) -> dict:
    """A metrics record less what the clock decides."""
    return {k: v for k, v in record.items() if not k.startswith("time/") and k not in ("tokens_per_s", "mfu")}


def lora_of(out: Path) -> dict[str, np.ndarray]:
    lora, _, _ = load_run(out)
    return {".".join(map(str, k)): np.asarray(jax.device_get(v[...])) for k, v in nnx.to_flat_state(lora)}


@pytest.fixture(scope="module")
def grpo_run(tiny_converted, inputs, tmp_path_factory):
    import finetune.train.loop

    finetune.train.loop.measure_peak_flops = lambda dtype: 1e12
    data, rewards_file = inputs
    out = tmp_path_factory.mktemp("grpo") / "run"
    assert main(cli(tiny_converted, data, out, rewards_file)) == 0
    return out


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["grpo", "rloo"])
def test_the_first_step_is_the_same_on_a_mesh_as_on_one_device(tmp_path, tiny_converted, inputs, objective):
    """The whole first step from a run's own completions: the tokens drawn, the advantages, the old and reference
    log-probabilities, the loss and the LoRA gradients (rloo: the KL in its rewards, the leave-one-out baseline)."""
    data, rewards_file = inputs
    options = rl_options(rewards_file)
    if objective == "rloo":
        options = {k: v for k, v in options.items() if k != "loss_type"} | {"objective": "rloo"}

    def config(mesh):
        return TrainConfig(model=str(tiny_converted), data=str(data), out=str(tmp_path / mesh), mesh=mesh,
                           progress=False, **options).validate()

    one = first_rollout_step(config("dp=1,fsdp=1,mp=1"), jax.devices()[:1])
    mesh = first_rollout_step(config("dp=2,fsdp=2,mp=2"), jax.devices())
    assert_same_first_step(mesh, one)


def assert_same_first_step(got: dict, expected: dict) -> None:
    np.testing.assert_array_equal(got["input_ids"], expected["input_ids"])
    advantages = expected["advantage"]
    assert (advantages > 0).any() and (advantages < 0).any()
    np.testing.assert_allclose(got["advantage"], advantages, rtol=0, atol=1e-5)  # rloo: a KL of float32 log-probs
    # the old log-probabilities, from a forward pass, are those the sampler drew the tokens with
    np.testing.assert_allclose(expected["old_logps"], expected["sampler_logps"], rtol=0, atol=2e-5)
    if "ref_logps" in expected:
        assert np.abs(expected["old_logps"] - expected["ref_logps"]).max() > 1e-3  # a nonzero adapter
    for name in ("old_logps", "ref_logps"):
        if name in expected:
            np.testing.assert_allclose(got[name], expected[name], rtol=0, atol=2e-5)
    assert abs(float(got["loss"]) - float(expected["loss"])) <= 1e-5 * max(1.0, abs(float(expected["loss"])))
    grads = [k for k in expected if k.endswith(("lora_a", "lora_b"))]
    assert grads
    for name in grads:
        scale = np.abs(expected[name]).max()
        assert scale > 0, name
        np.testing.assert_allclose(got[name], expected[name], rtol=0, atol=1e-5 * max(1.0, scale), err_msg=name)


@pytest.mark.e2e
def test_two_processes_take_the_first_step_one_device_takes(tmp_path, tiny_converted, two_process_grads):
    """The multi-process worker's "grpo" case: each process scores its own completions, the rewards are gathered,
    the advantages equal everywhere."""
    data, rewards_file = two_process_grads / "prompts.jsonl", str(two_process_grads / "rewards.py")
    config = TrainConfig(model=str(tiny_converted), data=str(data), out=str(tmp_path / "one"), mesh="dp=1,fsdp=1,mp=1",
                         progress=False, **rl_options(rewards_file)).validate()
    expected = first_rollout_step(config, jax.devices()[:1])
    assert_same_first_step(dict(np.load(two_process_grads / "grpo.npz")), expected)


@pytest.mark.e2e
def test_a_reward_failing_on_one_process_stops_both(two_process_grads):
    """The multi-process worker's "grpo-reward-fails" case: the reward raises on process 1's completions alone;
    process 1 names the function and its first failing row, process 0 says another process's reward failed, and
    neither waits for the other's rewards."""
    mine, other = ((two_process_grads / f"grpo-reward-fails-{i}.txt").read_text() for i in (1, 0))
    # (the files were written where the fixture was built, a directory renamed since)
    assert re.fullmatch(r"reward \S+/rewards\.py:fails_on_process_1: ValueError: not on this process "
                        r"\(\S+/prompts\.jsonl:\d+\)", mine), mine
    assert other == "a reward function failed on process 1 (see its error)"


TRL_STEP_METRICS = ("loss", "grad_norm", "lr", "kl", "clip_ratio/low_mean", "clip_ratio/high_mean",
                    "clip_ratio/region_mean", "reward", "reward_std", "rewards/starts_with_a_number/mean",
                    "rewards/starts_with_a_number/std", "rewards/close/mean", "rewards/close/std",
                    "frac_reward_zero_std", "completions/mean_length", "completions/min_length",
                    "completions/max_length", "completions/clipped_ratio")


@pytest.mark.slow
def test_a_grpo_run_logs_trls_metrics_its_completions_and_held_out_rewards(grpo_run):
    got = records(grpo_run)
    assert [r["step"] for r in got] == [0, 1, 2, 3, 4, 4]
    base, *steps, last = got
    assert set(base) == set(last) == {"step", "eval_reward", "eval_rewards/starts_with_a_number/mean",
                                      "eval_rewards/close/mean", "eval_completions/mean_length", "eval_generations"}
    assert [set(g) for g in last["eval_generations"]] == [{"prompt", "completion", "reward"}] * 2  # --eval-generate 2
    for record in steps:
        assert set(TRL_STEP_METRICS) <= set(record), sorted(set(TRL_STEP_METRICS) - set(record))
        assert 0 <= record["frac_reward_zero_std"] <= 1 and 1 <= record["completions/mean_length"] <= 6
        assert len(record["completions"]) == 4 and set(record["completions"][0]) == {"prompt", "completion", "reward"}
    # two iterations a batch of completions: steps 1 and 2 train on the same completions, 3 and 4 on new ones
    assert steps[0]["completions"] == steps[1]["completions"] != steps[2]["completions"] == steps[3]["completions"]
    assert ["time/sample_s" in r for r in steps] == [True, False, True, False]  # the seconds where they were spent
    assert steps[0]["kl"] == 0.0 < steps[1]["kl"]  # the adapter starts as the reference (B = 0)
    events = b"".join(p.read_bytes() for p in (grpo_run / "tensorboard").iterdir())
    assert b"completions" in events and b"rewards/close/mean" in events


@pytest.mark.slow
def test_a_resume_between_iterations_ends_where_the_uninterrupted_run_does(tmp_path, tiny_converted, inputs,
                                                                           grpo_run):
    """Stopped after step 1 (its batch of completions has a second iteration to go, kept with the checkpoint) and
    resumed: the same adapters and the same metrics, bit for bit."""
    data, rewards_file = inputs
    out = tmp_path / "run"
    assert main(cli(tiny_converted, data, out, rewards_file, "--stop-after", "1")) == 0
    assert (out / "checkpoints" / "1" / "rollout").is_dir()
    assert main(cli(tiny_converted, data, out, rewards_file, "--resume")) == 0
    assert [timeless(r) for r in records(out)] == [timeless(r) for r in records(grpo_run)]
    theirs = lora_of(grpo_run)
    for name, value in lora_of(out).items():
        np.testing.assert_array_equal(value, theirs[name], err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(n for n, case in RL_KNOBS.items() if case))
def test_resume_refuses_a_changed_rl_option(name, tiny_converted, inputs, grpo_run, capsys):
    data, rewards_file = inputs
    value, change = RL_KNOBS[name]
    before = sorted(p.stat().st_mtime_ns for p in grpo_run.rglob("*"))
    assert main(cli(tiny_converted, data, grpo_run, rewards_file, "--resume", **{name: value})) == 1
    lines = stderr_lines(capsys.readouterr().err)
    assert lines == [f"finetune-lora: error: --resume: {grpo_run} was trained with other settings, which a resume "
                     f"cannot change: --{name.replace('_', '-')}: {change.format(rewards=rewards_file)} (give them "
                     "as they were, or start a new run)"]
    assert sorted(p.stat().st_mtime_ns for p in grpo_run.rglob("*")) == before


@pytest.mark.slow
def test_a_grpo_run_exports_as_any_run_does(grpo_run, tmp_path):
    from safetensors.numpy import load_file

    from export.cli import main as export_main

    assert export_main(["--run", str(grpo_run), "--out", str(tmp_path / "adapter")]) == 0
    tensors = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    ours = lora_of(grpo_run)
    a = tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    np.testing.assert_array_equal(a, ours["layers.self_attn.q_proj.lora_a"][0].T)


@pytest.mark.parametrize("rows, extra, message", [
    ([{"question": "add 1 + 2 =", "answer": "3"}], (),
     "prompts.jsonl: --objective grpo samples completions of prompts, and the rows have no 'prompt' column (columns "
     "question, answer): give each row a prompt, a string or a messages list"),
    (None, ("--reward", "missing.py:f"), "--reward 'missing.py:f': no file missing.py"),
    (None, ("--reward", "{rewards}:nowhere"), "defines no function 'nowhere'"),
    (None, ("--data-format", "prompt-completion"), "--data-format prompt-completion does not go with --objective grpo"),
])
def test_bad_input_is_one_line_and_leaves_no_run(tmp_path, tiny_converted, inputs, capsys, rows, extra, message):
    data, rewards_file = inputs
    if rows is not None:
        data = write_jsonl(tmp_path / "prompts.jsonl", rows)
    extra = tuple(e.replace("{rewards}", rewards_file) for e in extra)
    args = ["--model", str(tiny_converted), "--data", str(data), "--out", str(tmp_path / "run"), "--objective", "grpo",
            "--no-progress", "--steps", "1", "--batch-size", "4", "--num-generations", "2"]
    if "--reward" not in extra:
        args += ["--reward", "equals:answer"]
    code = main(args + list(extra))
    lines = stderr_lines(capsys.readouterr().err)
    assert code != 0 and len(lines) == 1 and message in lines[0], lines
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_reward_that_returns_the_wrong_count_stops_the_run_in_one_line(tmp_path, tiny_converted, inputs, capsys):
    data, rewards_file = inputs
    out = tmp_path / "run"
    code = main(["--model", str(tiny_converted), "--data", str(data), "--out", str(out), "--objective", "grpo",
                 "--no-progress", "--steps", "2", "--batch-size", "2", "--num-generations", "2",
                 "--max-completion-length", "4", "--reward", f"{rewards_file}:short", "--mesh", "dp=1,fsdp=1,mp=1"])
    lines = stderr_lines(capsys.readouterr().err)
    assert code == 1 and len(lines) == 1, lines
    assert lines[0].startswith(f"finetune-lora: error: reward {rewards_file}:short: returned 1 rewards for 4 "
                               f"completions ({data}:")
    assert lines[0].endswith("; stopped before step 1; newest checkpoint kept: none"), lines[0]
    assert not list((out / "checkpoints").glob("*")) if (out / "checkpoints").exists() else True


def test_prompts_are_tokenized_as_the_sft_layouts_and_trl_render_them(tokenizer, tmp_path):
    """A string prompt as a prompt-completion row's prompt (BOS, then its text); messages as TRL renders them, the
    chat template's rendering with the generation prompt; --max-prompt-len keeps a prompt's end, and a chat's
    template whole. Nothing is trained; the other columns stay in the dataset for the rewards."""
    from finetune.data.reference import tokenize_row
    from finetune.data.sources import open_source
    from finetune.data.workers import tokenize_to_store

    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "add 3 + 4 " * 8}]
    text = "add 3 + 4 " * 8 + "="
    rows = [{"prompt": text, "answer": "7"}, {"prompt": chat, "answer": "7"}]
    source = open_source(str(write_jsonl(tmp_path / "p.jsonl", rows)))
    store = tokenize_to_store(source.dataset, tokenizer, None, _empty(tmp_path / "store"), layout="prompt-only")
    sft = tokenize_row("", {"prompt": text, "completion": " 7"}, tokenizer)
    assert store.example(0).ids.tolist() == sft.ids[~sft.trained].tolist()
    rendered = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    rendered = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    assert store.example(1).ids.tolist() == rendered
    assert not store.trained.any()
    bounded = tokenize_to_store(source.dataset, tokenizer, None, _empty(tmp_path / "bounded"), layout="prompt-only",
                                max_prompt=32)
    assert bounded.meta["prompts_cut"] == 2
    for e in range(2):
        ids = bounded.example(e).ids.tolist()
        assert len(ids) <= 32 and ids[-3:] == store.example(e).ids.tolist()[-3:]  # the end, next to the completion
    assert bounded.example(1).ids.tolist()[:8] == rendered[:8]  # BOS and the system turn kept


def _empty(path: Path) -> Path:
    path.mkdir()
    return path


def test_a_completion_that_ends_without_eos_was_cut():
    from finetune.train.rollouts import _stopped

    tokens = np.array([[5, 2, 0], [5, 6, 7], [2, 0, 0], [7, 8, 2]])
    np.testing.assert_array_equal(_stopped(tokens, np.array([2, 3, 1, 3]), (2,)), [True, False, True, True])


@pytest.mark.slow
def test_eval_generate_completes_held_out_prompts_as_greedy_generation_does(tmp_path, tiny_converted):
    """An SFT run with --eval-generate 3: its evaluation writes the first three held-out prompts' completions by the
    adapters it trained (the sampler reading them on a dp=2,fsdp=2 mesh), equal to `generate`'s greedy ones of the
    model with the run's adapters on one device, beside each prompt's own reply (a chat's: its first)."""
    from conftest import run_model
    from jaxmodel import generate

    rows = [{"prompt": f"add {a} + {b} =", "completion": f" {a + b}"} for a in range(5) for b in range(4)]
    data = write_jsonl(tmp_path / "sft.jsonl", rows)
    chat = {"messages": [{"role": "user", "content": "add 1 + 1"}, {"role": "assistant", "content": "2"},
                         {"role": "user", "content": "and 2 + 2?"}, {"role": "assistant", "content": "4"}]}
    held_out = write_jsonl(tmp_path / "held-out.jsonl", [chat, rows[0], {"text": "no prompt here"}, rows[1], rows[2]])
    out = tmp_path / "run"
    assert main(["--model", str(tiny_converted), "--data", str(data), "--eval-data", str(held_out), "--out", str(out),
                 "--steps", "2", "--batch-size", "4", "--seq-len", "32", "--lr", "1e-2", "--dtype", "float32",
                 "--mesh", "dp=2,fsdp=2,mp=1", "--eval-generate", "3", "--max-completion-length", "5",
                 "--no-progress"]) == 0
    written = records(out)[-1]["eval_generations"]
    # a chat's first reply (its first trained span), the rows' completions; the text row has no prompt: left out
    assert [g["reference"].strip() for g in written] == ["2", "0", "1"]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_converted)
    model = run_model(out, tiny_converted)
    for g, row in zip(written[1:], rows[:2]):
        ids = np.array([[tokenizer.bos_token_id, *tokenizer.encode(row["prompt"], add_special_tokens=False)]])
        tokens = generate(model, ids, 5)[0, ids.shape[1]:]
        stop = next((i + 1 for i, t in enumerate(tokens) if t == tokenizer.eos_token_id), len(tokens))
        assert g["completion"] == tokenizer.decode(tokens[:stop], skip_special_tokens=True)
        assert g["prompt"] == tokenizer.decode(ids[0])
