"""docs/config.md is generated from TrainConfig and must stay current; every option appears in it and in --help."""

import dataclasses
from pathlib import Path

from finetune.config import OBJECTIVE_DEFAULTS, SECTIONS, TrainConfig, build_parser, objective_defaults
from finetune.config_doc import config_markdown

DOC = Path(__file__).resolve().parent.parent / "docs" / "config.md"


def test_docs_config_md_is_up_to_date():
    assert DOC.read_text() == config_markdown(), (
        "docs/config.md is stale: regenerate it with `python -m finetune.config_doc > docs/config.md`")


def test_every_option_is_documented_with_its_default_in_its_section():
    text = config_markdown()
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        line = next((ln for ln in text.splitlines() if ln.startswith(f"| `{flag}")), None)
        assert line is not None, f"{flag} missing from docs/config.md"
        if f.name in OBJECTIVE_DEFAULTS:
            assert f"| {objective_defaults(f.name)} |" in line, line
        else:
            assert f"`{f.default}`" in line or (f.default in (None, ()) and "—" in line), line
        assert f.metadata["help"].split(" (")[0][:30] in line
    assert list(SECTIONS.values()) == [ln[3:] for ln in text.splitlines() if ln.startswith("## ")][:len(SECTIONS)]


def test_help_groups_the_options_by_section():
    text = build_parser("finetune-lora", "").format_help()
    positions = [text.index(f"{title}:") for title in SECTIONS.values()]
    assert positions == sorted(positions)
    assert text.index("\n  --rank") > text.index("LoRA:") > text.index("\n  --mesh")
