"""Every tool that writes a directory (convert-llama --out, export-peft --out / --merge) refuses, before any
work, a target that would lose something: a non-empty directory it did not write (unless --overwrite and the
directory is its own kind of output), another tool's output, its own inputs, or its other output; and it
clears the temporaries that killed writers left beside its target. Each refusal is one line, exit 1, and
leaves every file of every directory involved as it was."""

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from converter.cli import main as convert_main
from export.cli import main as export_main
from finetune.config import TrainConfig
from finetune.train.loop import run_training


def tree(root: Path) -> dict[str, str]:
    """Every entry under `root` (hidden ones too): files by content hash, symlinks by target, directories."""
    entries = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder) / name
            key = str(path.relative_to(root))
            if path.is_symlink():
                entries[key] = "-> " + os.readlink(path)
            elif path.is_dir():
                entries[key] = "dir"
            else:
                entries[key] = hashlib.sha256(path.read_bytes()).hexdigest()
    return entries


def cli(capsys, main, *args) -> tuple[int, list[str]]:
    code = main([str(a) for a in args])
    return code, capsys.readouterr().err.strip().splitlines()


def fake_adapter(path: Path) -> Path:
    """A directory that directory_kind() takes for a PEFT adapter (its content is never read here)."""
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text('{"peft_type": "LORA"}\n')
    (path / "adapter_model.safetensors").write_bytes(b"not read")
    return path


@pytest.fixture(scope="module")
def trained(tiny_converted, tmp_path_factory):
    """A private copy of the tiny converted base and a 2-step run on it (checkpoints at steps 1 and 2)."""
    root = tmp_path_factory.mktemp("trained")
    base = Path(shutil.copytree(tiny_converted, root / "base"))
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"add {i} + {i} =", "completion": f" {2 * i}"}) + "\n"
                            for i in range(16)))
    run_training(TrainConfig(model=str(base), data=str(data), out=str(root / "run"), steps=2, batch_size=8, seq_len=32,
                             dtype="float32", lr=1e-2, progress=False, checkpoint_every=1).validate())
    return root


@pytest.fixture
def ws(trained, tmp_path, tiny_checkpoint):
    """Private copies in tmp_path, free to break: `base` (converted), `run` (its run_config pointing at this
    `base`) and `hf` (the HF checkpoint `base` was converted from)."""
    base = Path(shutil.copytree(trained / "base", tmp_path / "base"))
    run = Path(shutil.copytree(trained / "run", tmp_path / "run"))
    config = json.loads((run / "run_config.json").read_text())
    (run / "run_config.json").write_text(json.dumps({**config, "model": str(base)}, indent=1) + "\n")
    hf = Path(shutil.copytree(tiny_checkpoint, tmp_path / "hf"))
    return SimpleNamespace(root=tmp_path, base=base, run=run, hf=hf)


@pytest.fixture
def no_work(monkeypatch):
    """Reading a run's checkpoints or a source's tensors fails the test: refusals must come before."""
    import converter.conversion
    import export.adapter

    def forbidden(*args, **kwargs):
        raise AssertionError("work started before the output directory was checked")

    monkeypatch.setattr(export.adapter, "load_run", forbidden)
    monkeypatch.setattr(converter.conversion, "list_tensors", forbidden)


# ---- export-peft: each case builds (extra arguments, the expected message) in the workspace ----------------

def _out_is_run(ws, overwrite):
    return ["--out", ws.run], f"--out {ws.run}: is --run ({ws.run}), an input of this command; refusing to replace it"


def _merge_is_base(ws, overwrite):
    return ["--merge", ws.base], (f"--merge {ws.base}: is the run's base model ({ws.base}), an input of this "
                                  "command; refusing to replace it")


def _out_is_base_through_dotdot(ws, overwrite):
    out = ws.run / ".." / "base"
    return ["--out", out], (f"--out {out}: is the run's base model ({ws.base}), an input of this command; "
                            "refusing to replace it")


def _merge_is_run_through_symlink(ws, overwrite):
    link = ws.root / "latest"
    link.symlink_to(ws.run, target_is_directory=True)
    return ["--merge", link], (f"--merge {link}: is --run ({ws.run}), an input of this command; "
                               "refusing to replace it")


def _out_contains_run(ws, overwrite):
    """An adapter directory (export-peft's own kind) that holds the run being exported."""
    adapter = fake_adapter(ws.root / "adapter")
    ws.run.rename(adapter / "run")
    ws.run = adapter / "run"
    return ["--out", adapter], (f"--out {adapter}: contains --run ({ws.run}), an input of this command; "
                                "refusing to replace it")


def _out_contains_run_reached_through_a_symlink(ws, overwrite):
    adapter = fake_adapter(ws.root / "adapter")
    ws.run.rename(adapter / "run")
    ws.run = ws.root / "latest"
    ws.run.symlink_to(adapter / "run", target_is_directory=True)
    return ["--out", adapter], (f"--out {adapter}: contains --run ({ws.run}), an input of this command; "
                                "refusing to replace it")


def _merge_contains_base(ws, overwrite):
    """A HF checkpoint directory (--merge's own kind) that holds the run's base model."""
    merged = Path(shutil.copytree(ws.hf, ws.root / "merged"))
    ws.base.rename(merged / "base")
    config = json.loads((ws.run / "run_config.json").read_text())
    (ws.run / "run_config.json").write_text(json.dumps({**config, "model": str(merged / "base")}))
    return ["--merge", merged], (f"--merge {merged}: contains the run's base model ({merged / 'base'}), an input of "
                                 "this command; refusing to replace it")


def _out_and_merge_same(ws, overwrite):
    out = ws.root / "export"
    return ["--out", out, "--merge", out], (f"--out {out}: is the same directory as --merge ({out}); give each its "
                                            "own directory")


def _out_and_merge_same_through_symlink(ws, overwrite):
    out, link = ws.root / "export", ws.root / "link"
    link.symlink_to(out, target_is_directory=True)  # dangling until written
    return ["--out", out, "--merge", link], (f"--out {out}: is the same directory as --merge ({link}); give each "
                                             "its own directory")


def _merge_inside_out(ws, overwrite):
    out = ws.root / "export"
    return (["--out", out, "--merge", out / "merged"],
            f"--out {out}: contains --merge ({out / 'merged'}); give each its own directory")


def _out_inside_merge(ws, overwrite):
    out = ws.root / "export"
    return (["--out", out / "adapter", "--merge", out],
            f"--out {out / 'adapter'}: is inside --merge ({out}); give each its own directory")


def _out_holds_converted(ws, overwrite):
    other = Path(shutil.copytree(ws.base, ws.root / "other-jax"))
    return ["--out", other], (f"--out {other}: holds a converted checkpoint, not a PEFT adapter; refusing to replace "
                              "it (choose another directory)")


def _out_holds_hf(ws, overwrite):
    return ["--out", ws.hf], (f"--out {ws.hf}: holds an HF checkpoint, not a PEFT adapter; refusing to replace it "
                              "(choose another directory)")


def _out_holds_hf_with_adapter_config(ws, overwrite):
    """A HF checkpoint with an adapter_config.json dropped into it is not an adapter directory."""
    (ws.hf / "adapter_config.json").write_text('{"peft_type": "LORA"}\n')
    return ["--out", ws.hf], (f"--out {ws.hf}: holds an HF checkpoint, not a PEFT adapter; refusing to replace it "
                              "(choose another directory)")


def _out_holds_other_run(ws, overwrite):
    other = Path(shutil.copytree(ws.run, ws.root / "other-run"))
    return ["--out", other], (f"--out {other}: holds a finetune-lora run, not a PEFT adapter; refusing to replace "
                              "it (choose another directory)")


def _merge_holds_adapter(ws, overwrite):
    adapter = fake_adapter(ws.root / "adapter")
    return ["--merge", adapter], (f"--merge {adapter}: holds a PEFT adapter, not an HF checkpoint; refusing to "
                                  "replace it (choose another directory)")


def _merge_holds_converted(ws, overwrite):
    other = Path(shutil.copytree(ws.base, ws.root / "other-jax"))
    return ["--merge", other], (f"--merge {other}: holds a converted checkpoint, not an HF checkpoint; refusing to "
                                "replace it (choose another directory)")


def _merge_holds_other_run(ws, overwrite):
    other = Path(shutil.copytree(ws.run, ws.root / "other-run"))
    return ["--merge", other], (f"--merge {other}: holds a finetune-lora run, not an HF checkpoint; refusing to "
                                "replace it (choose another directory)")


def _out_holds_unknown_files(ws, overwrite):
    notes = ws.root / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("keep me")
    return ["--out", notes], (f"--out {notes}: exists, is not empty and is not a PEFT adapter; refusing to replace "
                              "it (choose another directory)")


def _out_adapter_holding_a_run(ws, overwrite):
    adapter = fake_adapter(ws.root / "adapter")
    shutil.copytree(ws.run, adapter / "old-run")
    return ["--out", adapter], (f"--out {adapter}: holds a finetune-lora run in {adapter / 'old-run'}; refusing to "
                                "replace it (choose another directory)")


def _out_is_a_file(ws, overwrite):
    file = ws.root / "adapter.txt"
    file.write_text("a file")
    return ["--out", file], f"--out {file}: exists and is not a directory"


def _out_under_a_file(ws, overwrite):
    file = ws.root / "adapter.txt"
    file.write_text("a file")
    return ["--out", file / "adapter"], f"--out {file / 'adapter'}: {file} is not a directory"


def _fresh_out_but_merge_is_base(ws, overwrite):
    """--out alone is fine, but --merge is refused: nothing may be written to --out first."""
    return ["--out", ws.root / "new", "--merge", ws.base], (
        f"--merge {ws.base}: is the run's base model ({ws.base}), an input of this command; refusing to replace it")


EXPORT_REFUSALS = [_out_is_run, _merge_is_base, _out_is_base_through_dotdot, _merge_is_run_through_symlink,
                   _out_contains_run, _out_contains_run_reached_through_a_symlink, _merge_contains_base,
                   _out_and_merge_same, _out_and_merge_same_through_symlink, _merge_inside_out, _out_inside_merge,
                   _out_holds_converted, _out_holds_hf, _out_holds_hf_with_adapter_config, _out_holds_other_run,
                   _merge_holds_adapter, _merge_holds_converted, _merge_holds_other_run, _out_holds_unknown_files,
                   _out_adapter_holding_a_run, _out_is_a_file, _out_under_a_file, _fresh_out_but_merge_is_base]


@pytest.mark.slow
@pytest.mark.parametrize("overwrite", [False, True], ids=["plain", "overwrite"])
@pytest.mark.parametrize("case", EXPORT_REFUSALS, ids=lambda f: f.__name__.strip("_"))
def test_export_refuses_to_replace_what_it_must_not(ws, capsys, no_work, case, overwrite):
    args, message = case(ws, overwrite)
    before = tree(ws.root)
    code, err = cli(capsys, export_main, "--run", ws.run, *args, *(["--overwrite"] if overwrite else []))
    assert (code, err) == (1, [f"export-peft: error: {message}"])
    assert tree(ws.root) == before


@pytest.mark.slow
def test_export_refuses_its_own_kind_without_overwrite(ws, capsys, no_work):
    adapter = fake_adapter(ws.root / "adapter")
    before = tree(ws.root)
    code, err = cli(capsys, export_main, "--run", ws.run, "--out", adapter)
    assert (code, err) == (1, [f"export-peft: error: --out {adapter}: already holds a PEFT adapter "
                               "(pass --overwrite to replace it)"])
    code, err = cli(capsys, export_main, "--run", ws.run, "--merge", ws.hf)
    assert (code, err) == (1, [f"export-peft: error: --merge {ws.hf}: already holds an HF checkpoint "
                               "(pass --overwrite to replace it)"])
    assert tree(ws.root) == before


@pytest.mark.slow
def test_export_replaces_its_own_outputs_with_overwrite(ws, capsys):
    adapter, merged = ws.root / "adapter", ws.root / "merged"
    assert export_main(["--run", str(ws.run), "--step", "1", "--out", str(adapter), "--merge", str(merged)]) == 0
    first = {"adapter": tree(adapter), "merged": tree(merged)}
    inputs = {"run": tree(ws.run), "base": tree(ws.base)}
    capsys.readouterr()
    dead = _dead_pid()
    (ws.root / f".adapter.exporting-{dead}").mkdir()  # left by a killed export
    assert export_main(["--run", str(ws.run), "--step", "2", "--out", str(adapter), "--merge", str(merged),
                        "--overwrite"]) == 0
    assert "exported the LoRA adapters of step 2" in capsys.readouterr().out
    assert tree(adapter).keys() == first["adapter"].keys() and tree(adapter) != first["adapter"]
    assert "| training steps | 2 |" in (adapter / "README.md").read_text()
    assert tree(merged).keys() == first["merged"].keys() and tree(merged) != first["merged"]
    assert {"run": tree(ws.run), "base": tree(ws.base)} == inputs
    assert sorted(p.name for p in ws.root.iterdir()) == ["adapter", "base", "hf", "merged", "run"]


@pytest.mark.slow
def test_the_python_api_checks_too(ws, no_work):
    from export import export_adapter, export_merged
    from jaxmodel.formats.output_dir import OutputDirError

    before = tree(ws.root)
    with pytest.raises(OutputDirError, match=rf"^--out {ws.run}: is --run \({ws.run}\), an input"):
        export_adapter(ws.run, ws.run, overwrite=True)
    with pytest.raises(OutputDirError, match=rf"^--merge {ws.base}: is the run's base model"):
        export_merged(ws.run, ws.base, overwrite=True)
    assert tree(ws.root) == before


@pytest.mark.slow
def test_export_checks_the_outputs_before_reading_the_run(ws, capsys):
    """A run whose checkpoints are gone: the bad --out is reported, not the checkpoints."""
    shutil.rmtree(ws.run / "checkpoints")
    code, err = cli(capsys, export_main, "--run", ws.run, "--out", ws.base)
    assert (code, err) == (1, [f"export-peft: error: --out {ws.base}: is the run's base model ({ws.base}), an input "
                               "of this command; refusing to replace it"])


# ---- convert-llama ---------------------------------------------------------------------------------------

def _convert_out_is_src(ws, overwrite):
    return ws.hf, ws.hf, f"--out {ws.hf}: is --src ({ws.hf}), an input of this command; refusing to replace it"


def _convert_out_is_src_through_symlink(ws, overwrite):
    link = ws.root / "link"
    link.symlink_to(ws.hf, target_is_directory=True)
    return ws.hf, link, f"--out {link}: is --src ({ws.hf}), an input of this command; refusing to replace it"


def _convert_out_contains_src(ws, overwrite):
    """A converted checkpoint (convert-llama's own kind) that holds the HF checkpoint being converted."""
    src = ws.hf.rename(ws.base / "hf")
    return src, ws.base, f"--out {ws.base}: contains --src ({src}), an input of this command; refusing to replace it"


def _convert_out_contains_src_reached_through_a_symlink(ws, overwrite):
    ws.hf.rename(ws.base / "hf")
    link = ws.root / "hf-link"
    link.symlink_to(ws.base / "hf", target_is_directory=True)
    return link, ws.base, f"--out {ws.base}: contains --src ({link}), an input of this command; refusing to replace it"


def _convert_out_holds_run(ws, overwrite):
    return ws.hf, ws.run, (f"--out {ws.run}: holds a finetune-lora run, not a converted checkpoint; refusing to "
                           "replace it (choose another directory)")


def _convert_out_holds_adapter(ws, overwrite):
    adapter = fake_adapter(ws.root / "adapter")
    return ws.hf, adapter, (f"--out {adapter}: holds a PEFT adapter, not a converted checkpoint; refusing to "
                            "replace it (choose another directory)")


def _convert_out_holds_other_hf(ws, overwrite):
    other = Path(shutil.copytree(ws.hf, ws.root / "other-hf"))
    return ws.hf, other, (f"--out {other}: holds an HF checkpoint, not a converted checkpoint; refusing to replace "
                          "it (choose another directory)")


def _convert_out_holds_unknown_files(ws, overwrite):
    notes = ws.root / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("keep me")
    return ws.hf, notes, (f"--out {notes}: exists, is not empty and is not a converted checkpoint; refusing to "
                          "replace it (choose another directory)")


def _convert_out_is_a_file(ws, overwrite):
    file = ws.root / "out.txt"
    file.write_text("a file")
    return ws.hf, file, f"--out {file}: exists and is not a directory"


CONVERT_REFUSALS = [_convert_out_is_src, _convert_out_is_src_through_symlink, _convert_out_contains_src,
                    _convert_out_contains_src_reached_through_a_symlink,
                    _convert_out_holds_run, _convert_out_holds_adapter, _convert_out_holds_other_hf,
                    _convert_out_holds_unknown_files, _convert_out_is_a_file]


@pytest.mark.parametrize("overwrite", [False, True], ids=["plain", "overwrite"])
@pytest.mark.parametrize("case", CONVERT_REFUSALS, ids=lambda f: f.__name__.strip("_"))
@pytest.mark.slow
def test_convert_refuses_to_replace_what_it_must_not(ws, capsys, no_work, case, overwrite):
    src, out, message = case(ws, overwrite)
    before = tree(ws.root)
    code, err = cli(capsys, convert_main, "--src", src, "--out", out, "--no-progress",
                    *(["--overwrite"] if overwrite else []))
    assert (code, err) == (1, [f"convert-llama: error: {message}"])
    assert tree(ws.root) == before


@pytest.mark.slow
def test_convert_replaces_a_converted_checkpoint_only_with_overwrite(ws, capsys):
    manifest = ws.base / "jax_checkpoint.json"
    before = tree(ws.root)
    code, err = cli(capsys, convert_main, "--src", ws.hf, "--out", ws.base, "--no-progress", "--dtype", "bfloat16")
    assert (code, err) == (1, [f"convert-llama: error: --out {ws.base}: already holds a converted checkpoint "
                               "(pass --overwrite to replace it)"])
    assert tree(ws.root) == before
    code, err = cli(capsys, convert_main, "--src", ws.hf, "--out", ws.base, "--no-progress", "--dtype", "bfloat16",
                    "--overwrite")
    assert (code, err) == (0, [])
    assert {e["dtype"] for e in json.loads(manifest.read_text())["tensors"].values()} == {"bfloat16"}
    assert {k: v for k, v in tree(ws.root).items() if not k.startswith("base")} == \
        {k: v for k, v in before.items() if not k.startswith("base")}


# ---- temporaries left by killed writers -----------------------------------------------------------------

def _dead_pid() -> int:
    """The pid of a process that has finished (and been reaped)."""
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


@pytest.fixture
def live_pid():
    process = subprocess.Popen(["sleep", "300"])
    yield process.pid
    process.kill()
    process.wait()


@pytest.mark.slow
def test_convert_removes_temporaries_of_dead_writers_only(ws, capsys, live_pid):
    out = ws.root / "out"
    dead = _dead_pid()
    for name in (f".out.converting-{dead}", f".out.merging-{dead}", f".out.converting-{live_pid}",
                 f".other.converting-{dead}", f".out.b.converting-{dead}"):
        (ws.root / name).mkdir()
        (ws.root / name / "params").mkdir()
        (ws.root / name / "params" / "half-written.safetensors").write_bytes(b"\0" * 100)
    code, err = cli(capsys, convert_main, "--src", ws.hf, "--out", out, "--no-progress")
    assert (code, err) == (0, [])
    assert sorted(p.name for p in ws.root.iterdir() if p.name.startswith(".")) == \
        sorted([f".out.converting-{live_pid}", f".other.converting-{dead}", f".out.b.converting-{dead}"])


@pytest.mark.slow
def test_a_writer_killed_while_replacing_loses_nothing(ws, capsys):
    """Killed between moving the old output aside and renaming the new one in: the next run puts the old
    one back (and so refuses to replace it without --overwrite)."""
    dead = _dead_pid()
    out = ws.root / "out"
    ws.base.rename(ws.root / f".out.replaced-{dead}")
    shutil.copytree(ws.root / f".out.replaced-{dead}", ws.root / f".out.converting-{dead}")
    old = tree(ws.root / f".out.replaced-{dead}")
    code, err = cli(capsys, convert_main, "--src", ws.hf, "--out", out, "--no-progress")
    assert (code, err) == (1, [f"convert-llama: error: --out {out}: already holds a converted checkpoint "
                               "(pass --overwrite to replace it)"])
    assert tree(out) == old
    assert sorted(p.name for p in ws.root.iterdir()) == ["hf", "out", "run"]
