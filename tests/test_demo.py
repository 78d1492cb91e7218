"""The Quick start demo, reduced: build, convert, fine-tune on a dp x fsdp x mp mesh, export, serve with PEFT."""

import pytest

from demo.cli import LOGIT_TOLERANCE, build_parser, run_demo


@pytest.mark.e2e
def test_demo_pipeline_trains_and_peft_serves_the_same_model(tmp_path, capfd):
    args = build_parser().parse_args(["--out", str(tmp_path / "demo"), "--layers", "2", "--test-size", "40",
                                      "--", "--steps", "40", "--eval-every", "20", "--no-progress"])
    result = run_demo(args)

    losses, scores = result["losses"], result["scores"]
    assert len(losses) == 40 and losses[-1] < 0.5 * losses[0]
    assert scores["n"] == 40
    assert scores["adapted_accuracy"] > scores["base_accuracy"]
    assert scores["logit_diff"] <= LOGIT_TOLERANCE * max(1.0, scores["logit_max"])
    paths = result["paths"]
    assert (paths["adapter"] / "adapter_model.safetensors").is_file()
    assert (paths["run"] / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    output = capfd.readouterr()
    assert "finetune-lora --config" in output.out
    # the embedding lookup on a dp=2,fsdp=2,mp=2 mesh once made the partitioner replicate the whole table
    assert "Involuntary full rematerialization" not in output.err


def test_reverse_words_holds_out_word_orders_never_trained_on():
    from demo.reverse_words import accuracy, split

    train, test = split(seed=0, test_size=200)
    prompts = lambda rows: {r["messages"][0]["content"] for r in rows}
    assert len(test) == 200 and len(train) + len(test) == 16 * 15 * 14
    assert not prompts(train) & prompts(test)
    assert split(seed=0, test_size=200) == (train, test) and split(seed=1, test_size=200)[1] != test
    assert test[0]["messages"][1]["content"] == " ".join(reversed(test[0]["messages"][0]["content"].split()[1:]))
    assert accuracy([" " + test[0]["messages"][1]["content"], "wrong"], test[:2]) == 0.5


def test_demo_words_are_single_tokens_of_the_tiny_tokenizer(tiny_checkpoint):
    from transformers import AutoTokenizer

    from demo.reverse_words import WORDS
    from demo.tiny import CORPUS_WORDS

    assert set(WORDS) <= set(CORPUS_WORDS)
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    for word in WORDS:
        assert len(tokenizer.encode(" " + word, add_special_tokens=False)) == 1, word


def test_the_demo_checkpoint_is_reused_only_when_built_the_same_way(tmp_path):
    from demo.cli import build_or_reuse_checkpoint

    hf = tmp_path / "hf-llama"
    assert build_or_reuse_checkpoint(hf, seed=0, layers=1)
    assert not build_or_reuse_checkpoint(hf, seed=0, layers=1)
    assert build_or_reuse_checkpoint(hf, seed=1, layers=1)
    assert build_or_reuse_checkpoint(hf, seed=1, layers=2)
    assert '"num_hidden_layers": 2' in (hf / "config.json").read_text()
    assert build_or_reuse_checkpoint(hf, seed=1, layers=2, rebuild=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf-llama", "hf-llama.recipe.json"]


@pytest.mark.parametrize("args, message", [
    (["--layers", "0"], "--layers must be a positive integer, got 0"),
    (["--test-size", "3360"], "--test-size 3360 leaves no word orders to train on"),
])
def test_bad_demo_options_are_one_line_errors(tmp_path, capsys, args, message):
    from demo.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--out", str(tmp_path / "demo"), *args])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"llama-jax-demo: error: {message}"
    assert not (tmp_path / "demo").exists()


@pytest.mark.e2e
def test_demo_on_an_nf4_base_trains_there_and_peft_serves_the_adapter_on_the_unquantized_base(tmp_path, capfd):
    """QLoRA through the demo: the adapters train on the NF4 base, the JAX accuracy on that base is reported beside
    PEFT's on the unquantized one, and the export serves there as JAX computes it. Short, as the other demo test:
    whether the accuracies agree depends on training to convergence, not on the software (docs/benchmarks.md,
    "QLoRA in the demo"); one device, the mesh being the other test's concern."""
    args = build_parser().parse_args(["--out", str(tmp_path / "demo"), "--layers", "2", "--test-size", "40",
                                      "--quantize", "nf4", "--devices", "1", "--", "--steps", "40",
                                      "--eval-every", "20", "--mesh", "dp=1,fsdp=1,mp=1", "--no-progress"])
    result = run_demo(args)
    scores = result["scores"]
    assert result["losses"][-1] < 0.5 * result["losses"][0]
    assert result["paths"]["quantized"].name == "jax-llama-nf4"
    assert 0 <= scores["quantized_accuracy"] <= 1 and scores["n"] == 40
    assert scores["logit_diff"] <= LOGIT_TOLERANCE * max(1.0, scores["logit_max"])  # the export, unquantized
    assert "--quantize nf4" in capfd.readouterr().out
