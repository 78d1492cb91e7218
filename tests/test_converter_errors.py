"""Bad input to convert-llama: a non-zero exit, one line naming the file/field and what was expected,
no traceback, and nothing left at --out (or beside it) that looks finished."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from converter.cli import main


@pytest.fixture
def src(tmp_path, tiny_checkpoint) -> Path:
    """A private copy of the sharded tiny checkpoint, free to break."""
    return Path(shutil.copytree(tiny_checkpoint, tmp_path / "src"))


def run(capsys, *args) -> tuple[int, str]:
    code = main([*args, "--no-progress"])
    err = capsys.readouterr().err
    return code, err


def assert_clean_failure(code: int, err: str, tmp_path: Path, *needles: str) -> None:
    assert code != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("convert-llama: error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    leftovers = [p.name for p in tmp_path.iterdir() if p.name not in ("src", "existing")]
    assert leftovers == [], f"left behind: {leftovers}"


def test_truncated_safetensors(capsys, tmp_path, src):
    shard = sorted(src.glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-100])
    code, err = run(capsys, "--src", str(src), "--out", str(tmp_path / "out"))
    assert_clean_failure(code, err, tmp_path, shard.name, "truncated")


def test_shard_listed_in_index_but_missing(capsys, tmp_path, src):
    shard = sorted(src.glob("model-*.safetensors"))[2]
    shard.unlink()
    code, err = run(capsys, "--src", str(src), "--out", str(tmp_path / "out"))
    assert_clean_failure(code, err, tmp_path, "model.safetensors.index.json", shard.name, "missing")


def bump(key, by):
    return lambda config: {**config, key: config[key] + by}


@pytest.mark.parametrize("edit, needles", [
    (bump("intermediate_size", 8), ("mlp.", "has shape", "config.json implies")),  # shape disagrees with config
    (bump("num_hidden_layers", 1), ("missing tensor 'model.layers.2.", "config.json implies")),  # missing tensor
    (lambda c: {**c, "model_type": "gpt_neox"}, ("config.json", "'model_type'", "'gpt_neox'",
                                                 "supported: llama, mistral, qwen2, qwen3, gemma3_text, gemma3, "
                                                 "qwen3_moe, mixtral, deepseek_v3")),
    # a Llama checkpoint labelled Qwen3: the head norms Qwen3 implies are missing
    (lambda c: {**c, "model_type": "qwen3"}, ("missing tensor 'model.layers.0.self_attn.k_norm.weight'",
                                              "config.json implies")),
    (lambda c: {**c, "num_attention_heads": "four"}, ("config.json", "'num_attention_heads'", "must be int")),
    (lambda c: {**c, "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "factor": 4.0}},
     ("rope_parameters.rope_type", "'longrope'", "default, linear, llama3, yarn")),
    (lambda c: {**c, "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": -2}},
     ("rope_parameters.beta_fast", "must be a non-negative number, got -2")),
])
def test_config_json_that_does_not_fit_the_weights(capsys, tmp_path, src, edit, needles):
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(edit(config)))
    code, err = run(capsys, "--src", str(src), "--out", str(tmp_path / "out"))
    assert_clean_failure(code, err, tmp_path, *needles)


def test_malformed_config(capsys, tmp_path, src):
    (src / "config.json").write_text('{"model_type": "llama", "hidden_size": 64,')
    code, err = run(capsys, "--src", str(src), "--out", str(tmp_path / "out"))
    assert_clean_failure(code, err, tmp_path, "config.json", "not valid JSON")


def test_existing_nonempty_out_without_overwrite(capsys, tmp_path, src):
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "notes.txt").write_text("keep me")
    for overwrite in ([], ["--overwrite"]):  # --overwrite replaces converted checkpoints only
        code, err = run(capsys, "--src", str(src), "--out", str(existing), *overwrite)
        assert_clean_failure(code, err, tmp_path, f"--out {existing}: exists, is not empty and is not a converted "
                             "checkpoint; refusing to replace it (choose another directory)")
        assert [p.name for p in existing.iterdir()] == ["notes.txt"]


def test_no_checkpoint_in_directory(capsys, tmp_path, src):
    for f in src.glob("model*"):
        f.unlink()
    code, err = run(capsys, "--src", str(src), "--out", str(tmp_path / "out"))
    assert_clean_failure(code, err, tmp_path, str(src), "no checkpoint found")


def test_failure_after_planning_leaves_no_output(capsys, tmp_path, src, monkeypatch):
    """A failure mid-copy (here: the disk refusing a write) removes the half-written directory."""
    import os

    def failing_pwrite(fd, data, offset):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "pwrite", failing_pwrite)
    code, err = run(capsys, "--src", str(src), "--out", str(tmp_path / "out"))
    assert_clean_failure(code, err, tmp_path, "No space left on device")


@pytest.mark.slow
def test_the_installed_command_exits_nonzero_with_one_line(tmp_path, src):
    config = json.loads((src / "config.json").read_text())
    config["model_type"] = "gpt2"
    (src / "config.json").write_text(json.dumps(config))
    result = subprocess.run([sys.executable, "-m", "converter.cli", "--src", str(src), "--out",
                             str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"convert-llama: error: {src / 'config.json'}: field 'model_type' is 'gpt2'; supported: llama, mistral, qwen2, "
        "qwen3, gemma3_text, gemma3, qwen3_moe, mixtral, deepseek_v3"
    ]
    assert not (tmp_path / "out").exists()
