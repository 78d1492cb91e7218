"""One process of tests/test_fused_attention.py's 2-process test: `choose_attention` as an NVIDIA GPU's run makes
it, on packed rows (which cuDNN refuses), where process 0's check passes Pallas and process 1's does not, joined over
loopback (gloo); each process writes the choice it took."""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"

import jax  # noqa: E402

from finetune.config import TrainConfig  # noqa: E402
from finetune.step.attention_choice import choose_attention  # noqa: E402
from jaxmodel.config import ModelConfig  # noqa: E402


def main(out, port, process_id):
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=int(process_id))
    llama = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5)
    config = TrainConfig(dtype="bfloat16", seq_len=256, attention="auto")

    def check(impl, call):  # the processes' checks differ on Pallas
        return "disagrees here" if jax.process_index() == 1 else None

    choice = choose_attention(config, llama, 1, platform="cuda", check=check)
    with open(os.path.join(out, f"choice-{jax.process_index()}.json"), "w") as f:
        json.dump({"impl": choice.impl, "why": choice.why}, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
