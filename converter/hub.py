"""Resolve `--src`: a local directory, or a hub id found through huggingface_hub's cache."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from converter.errors import ConversionError

# What a conversion needs from a hub repo: weights, configs, tokenizer files; never original/*.pth.
HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.jinja"]
HUB_BIN_PATTERNS = ["pytorch_model*.bin"]
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def resolve_source(src: str, revision: str | None = None) -> Path:
    """The local directory holding the checkpoint named by `src`.

    A hub id is looked up in the local cache first; only when it is absent, and the hub is not offline
    (`HF_HUB_OFFLINE=1`), is it downloaded.
    """
    path = Path(src).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ConversionError(f"{src}: expected a checkpoint directory or a hub id, found a file")
        return path
    if not _REPO_ID.fullmatch(src):
        raise ConversionError(f"{src}: no such directory, and not a hub id of the form 'org/name'")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return _snapshot(snapshot_download, src, revision, local_files_only=True)
    except LocalEntryNotFoundError:
        pass
    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        raise ConversionError(
            f"{src}: not in the local HuggingFace cache ({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE is set; "
            f"download it first (`hf download {src}`) or pass a local directory"
        )
    try:
        return _snapshot(snapshot_download, src, revision, local_files_only=False)
    except (HfHubHTTPError, RepositoryNotFoundError, LocalEntryNotFoundError, OSError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConversionError(f"{src}: cannot be fetched from the hub ({first_line})") from None


def _snapshot(snapshot_download, repo_id: str, revision: str | None, *, local_files_only: bool) -> Path:
    folder = Path(snapshot_download(repo_id, revision=revision, allow_patterns=HUB_PATTERNS,
                                    local_files_only=local_files_only))
    if not any(folder.glob("*.safetensors")):  # an old repo with torch pickles only
        folder = Path(snapshot_download(repo_id, revision=revision, allow_patterns=HUB_PATTERNS + HUB_BIN_PATTERNS,
                                        local_files_only=local_files_only))
    return folder


def source_record(src: str | Path, source_dir: Path) -> dict[str, str]:
    """What a converted checkpoint records of where it came from (`jaxmodel.formats.checkpoint.checkpoint_source`):
    the hub id and the commit of its cached snapshot (the snapshot directory's name), or the local directory's
    absolute path; the digest of its config.json and this converter's version."""
    if Path(src).expanduser().exists():
        record = {"path": str(Path(src).expanduser().resolve())}
    else:
        record = {"hub_id": str(src), "revision": source_dir.name}
    config = source_dir / "config.json"
    if config.is_file():
        record["config_sha256"] = hashlib.sha256(config.read_bytes()).hexdigest()
    record["converter_version"] = converter_version()
    return record


def converter_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("llama-jax")
    except PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown"
