"""Where a base came from, carried along the chain: convert-llama records its source in the manifest,
finetune-lora copies it into the run, export-peft names it in adapter_config.json, the model card and a merge."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import numpy as np
import pytest

from test_converter import make_hub_cache  # the cache layout huggingface_hub reads
from export.cli import main as export_main
from finetune.config import TrainConfig
from finetune.run.files import BASE_SOURCE
from jaxmodel.formats.checkpoint import MANIFEST, CheckpointError, read_manifest, verify_checkpoint

IDS = np.random.default_rng(7).integers(6, 512, (2, 13))


def train(model: Path, out: Path) -> Path:
    from finetune.train.loop import run_training

    data = out.parent / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"add {i} + {i} =", "completion": f" {2 * i}"}) + "\n"
                            for i in range(16)))
    run_training(TrainConfig(model=str(model), data=str(data), out=str(out), steps=2, batch_size=8, seq_len=32,
                             dtype="float32", lr=1e-2, progress=False, checkpoint_every=100).validate())
    return out


def auto_peft_logits(adapter: Path, env: dict | None = None) -> np.ndarray:
    """`AutoPeftModelForCausalLM.from_pretrained(adapter)` with no other argument, in a fresh process (the hub cache
    is read from its environment), offline; its logits for IDS."""
    code = ("import sys, numpy as np, torch; from peft import AutoPeftModelForCausalLM\n"
            "model = AutoPeftModelForCausalLM.from_pretrained(sys.argv[1]).eval()\n"
            "ids = torch.tensor(np.array(eval(sys.argv[2])))\n"
            "with torch.no_grad(): np.save(sys.argv[3], model(ids).logits.float().numpy())\n")
    out = adapter.parent / f"{adapter.name}-logits.npy"
    result = subprocess.run([sys.executable, "-c", code, str(adapter), repr(IDS.tolist()), str(out)],
                            env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return np.load(out)


def peft_logits(hf_dir: Path, adapter: Path) -> np.ndarray:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(hf_dir), adapter).eval()
    with torch.no_grad():
        return model(torch.tensor(IDS)).logits.float().numpy()


def adapter_config(adapter: Path) -> dict:
    return json.loads((adapter / "adapter_config.json").read_text())


def test_conversion_records_the_local_source_and_verifies(tiny_checkpoint, tiny_converted):
    manifest = read_manifest(tiny_converted)
    assert manifest["source"] == {
        "path": str(tiny_checkpoint.resolve()),
        "config_sha256": hashlib.sha256((tiny_checkpoint / "config.json").read_bytes()).hexdigest(),
        "converter_version": version("llama-jax"),
    }
    assert manifest["version"] == 1  # no new version: readers that predate the record keep reading it
    assert verify_checkpoint(tiny_converted) > 0


def test_a_malformed_source_is_one_line(tmp_path, tiny_converted):
    copy = tmp_path / "conv"
    shutil.copytree(tiny_converted, copy)
    manifest = json.loads((copy / MANIFEST).read_text())
    (copy / MANIFEST).write_text(json.dumps({**manifest, "source": {"revision": "abc"}}))
    with pytest.raises(CheckpointError, match=r"jax_checkpoint.json: 'source': expected .*found \{'revision': 'abc'\}"):
        read_manifest(copy)


@pytest.mark.slow
def test_local_chain_names_the_hf_directory(tmp_path, tiny_checkpoint, tiny_converted, capsys):
    run = train(tiny_converted, tmp_path / "run")
    assert json.loads((run / BASE_SOURCE).read_text()) == read_manifest(tiny_converted)["source"]
    capsys.readouterr()  # the run's own report
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    assert export_main(["--run", str(run), "--out", str(adapter), "--merge", str(merged)]) == 0
    assert capsys.readouterr().err == ""
    hf_dir = str(tiny_checkpoint.resolve())
    config = adapter_config(adapter)
    assert (config["base_model_name_or_path"], config["revision"]) == (hf_dir, None)
    assert f"base_model: {hf_dir}" in (adapter / "README.md").read_text().splitlines()

    theirs = auto_peft_logits(adapter)
    expected = peft_logits(tiny_checkpoint, adapter)
    np.testing.assert_allclose(theirs, expected, rtol=0, atol=1e-5)

    assert json.loads((merged / "config.json").read_text())["_name_or_path"] == hf_dir
    card = (merged / "README.md").read_text()
    assert f"base_model: {hf_dir}" in card.splitlines() and f"run {run.resolve()}, step 2" in card

    override = tmp_path / "override"
    assert export_main(["--run", str(run), "--out", str(override), "--base-model", "meta-llama/Llama-3.2-1B"]) == 0
    config = adapter_config(override)
    assert (config["base_model_name_or_path"], config["revision"]) == ("meta-llama/Llama-3.2-1B", None)
    assert "base_model: meta-llama/Llama-3.2-1B" in (override / "README.md").read_text().splitlines()


@pytest.mark.slow
def test_hub_chain_names_the_hub_id_and_commit_and_loads_offline(tmp_path, tiny_checkpoint):
    cache = tmp_path / "hub"
    commit = make_hub_cache(cache, "org/Tiny-Llama", tiny_checkpoint)
    env = {"HF_HUB_CACHE": str(cache)}
    converted = tmp_path / "conv"
    result = subprocess.run([sys.executable, "-m", "converter.cli", "--src", "org/Tiny-Llama", "--out", str(converted),
                             "--verify", "--no-progress"], env={**os.environ, "HF_HUB_OFFLINE": "1", **env},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    source = read_manifest(converted)["source"]
    assert (source["hub_id"], source["revision"]) == ("org/Tiny-Llama", commit) and "path" not in source

    run = train(converted, tmp_path / "run")
    adapter = tmp_path / "adapter"
    assert export_main(["--run", str(run), "--out", str(adapter)]) == 0
    config = adapter_config(adapter)
    assert (config["base_model_name_or_path"], config["revision"]) == ("org/Tiny-Llama", commit)
    card = (adapter / "README.md").read_text().splitlines()
    assert "base_model: org/Tiny-Llama" in card and f"| base revision | {commit} |" in card
    np.testing.assert_allclose(auto_peft_logits(adapter, env), peft_logits(tiny_checkpoint, adapter), rtol=0,
                               atol=1e-5)


@pytest.mark.slow
def test_an_older_conversion_exports_as_before_with_a_note(tmp_path, tiny_converted, capsys):
    older = tmp_path / "older"
    shutil.copytree(tiny_converted, older)
    manifest = json.loads((older / MANIFEST).read_text())
    del manifest["source"]
    (older / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    run = train(older, tmp_path / "run")
    assert not (run / BASE_SOURCE).exists()
    capsys.readouterr()
    adapter = tmp_path / "adapter"
    assert export_main(["--run", str(run), "--out", str(adapter)]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("export-peft: note: ") and \
        "--base-model HUB_ID_OR_HF_DIR" in err[0], err
    config = adapter_config(adapter)
    assert (config["base_model_name_or_path"], config["revision"]) == (str(older), None)

    assert export_main(["--run", str(run), "--out", str(tmp_path / "named"), "--base-model", "org/name"]) == 0
    assert capsys.readouterr().err == ""
    assert adapter_config(tmp_path / "named")["base_model_name_or_path"] == "org/name"
