"""One process of the pair behind the 2-process tests (tests/conftest.py's `two_process_grads`): for each case of
CASES, the loss and LoRA gradients of the first global batch computed across the 2 processes over loopback (gloo),
written by process 0 to OUT/<case>.npz. One pair serves every case, so that starting and joining the processes is
paid once."""

import os
import sys

from isolation import QUICK_COMPILE_FLAGS

# Compiled as the test process whose one-device results this one's are compared with (tests/conftest.py)
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count=4 {QUICK_COMPILE_FLAGS}"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from finetune.config import TrainConfig  # noqa: E402
from finetune.data.order import row_indices  # noqa: E402
from finetune.step.preference import Objective  # noqa: E402
from finetune.step.train_step import loss_and_grads, preference_loss_and_grads  # noqa: E402
from finetune.train.build import setup  # noqa: E402
from finetune.train.batches import pair_batch  # noqa: E402
from finetune.train.loop import global_batch  # noqa: E402

# case: (its data file in OUT, the mesh, the objective); the tests that read each case name its data file's maker
CASES = {
    "sft": ("sft.jsonl", "dp=2,fsdp=4,mp=1", "sft"),  # test_finetune.py
    "cp": ("packed.jsonl", "dp=1,fsdp=2,cp=4,mp=1", "sft"),  # test_context_parallel.py
    "dpo": ("pairs.jsonl", "dp=2,fsdp=4,mp=1", "dpo"),  # test_preference_paths.py: the reference in the step,
    "dpo-precomputed": ("pairs.jsonl", "dp=2,fsdp=4,mp=1", "dpo-precomputed"),  # or computed before the steps
    # test_moe_families.py: the experts held by fsdp's devices across the processes, on OUT/moe (conftest's TINY_MOE)
    "moe": ("packed.jsonl", "dp=1,fsdp=4,cp=1,mp=2", "sft"),
    # test_deepseek.py: latent attention, and 2 routed experts a device, on OUT/deepseek (tiny_moe's TINY_DEEPSEEK)
    "deepseek": ("packed.jsonl", "dp=1,fsdp=4,cp=1,mp=2", "sft"),
    # test_rl_runs.py: a GRPO run's first step from its own completions (tests/rl_cases.py), OUT/rewards.py scoring them
    "grpo": ("prompts.jsonl", "dp=2,fsdp=2,cp=1,mp=2", "grpo"),
    # test_rl_runs.py: a reward that raises on process 1's completions alone stops both processes, each in one line
    "grpo-reward-fails": ("prompts.jsonl", "dp=2,fsdp=2,cp=1,mp=2", "grpo-reward-fails"),
}


def case(model, out, port, process_id, name):
    data, mesh, objective = CASES[name]
    if objective.startswith("grpo"):
        from rl_cases import first_rollout_step, rl_options

        rewards = os.path.join(out, "rewards.py")
        options = rl_options(rewards)
        if objective == "grpo-reward-fails":
            options |= {"reward": (f"{rewards}:fails_on_process_1",), "reward_weights": None}
        config = TrainConfig(model=model, data=os.path.join(out, data), out=os.path.join(out, name), mesh=mesh,
                             progress=False, coordinator=f"127.0.0.1:{port}", num_processes=2,
                             process_id=int(process_id), **options).validate()
        if objective == "grpo-reward-fails":
            from finetune.rollout.rewards import RewardError

            try:
                first_rollout_step(config)
                message = "no error"
            except RewardError as e:
                message = str(e)
            with open(os.path.join(out, f"{name}-{jax.process_index()}.txt"), "w") as f:
                f.write(message)
            return
        result = first_rollout_step(config)
        if jax.process_index() == 0:
            np.savez(os.path.join(out, f"{name}.npz"), **result)
        return
    # a preference run as tests/test_preference_training.py's `config` makes it
    preference = {}
    if objective.startswith("dpo"):
        preference = {"objective": "dpo", "targets": "q_proj,v_proj", "remat": "none",
                      "precompute_reference": objective == "dpo-precomputed"}
    if name == "moe":
        from tiny_moe import MOE_MESH_TARGETS

        model, preference = os.path.join(out, "moe"), {"targets": MOE_MESH_TARGETS}
    if name == "deepseek":
        from tiny_moe import DEEPSEEK_MESH_TARGETS

        model, preference = os.path.join(out, "deepseek"), {"targets": DEEPSEEK_MESH_TARGETS}
    config = TrainConfig(model=model, data=os.path.join(out, data), out=os.path.join(out, name), mesh=mesh, steps=1,
                         batch_size=8, seq_len=32, dtype="float32", progress=False, coordinator=f"127.0.0.1:{port}",
                         num_processes=2, process_id=int(process_id), **preference).validate()
    run = setup(config)  # joins the other process at the first case
    assert jax.process_count() == 2 and jax.device_count() == 8 and jax.local_device_count() == 4
    lora = jax.tree.map(lambda x: x + 0.01 * jax.random.normal(jax.random.key(1), x.shape, x.dtype), run.state.lora)
    with jax.set_mesh(run.mesh):
        if config.preference:
            base, reference = run.frozen
            batch = pair_batch(run.train_rows, run.batch_sharding, 0)
            fn = jax.jit(lambda lora, base, batch: preference_loss_and_grads(
                run.graphdef, lora, base, reference, batch, Objective.of(config), config.batch_size,
                loss_chunk=config.loss_chunk))
            loss, metrics, grads = fn(lora, base, batch)
            count = metrics["pairs"]
        else:
            batch = global_batch(run.train_rows, lambda lo, hi: row_indices(len(run.train_rows), 0, 0, 8, lo, hi),
                                  run.batch_sharding, 8)
            fn = jax.jit(lambda lora, base, batch: loss_and_grads(run.graphdef, lora, base, batch,
                                                                  loss_chunk=config.loss_chunk))
            loss, count, grads = fn(lora, run.base, batch)
        gathered = multihost_utils.process_allgather((loss, count, grads), tiled=True)
    if jax.process_index() == 0:
        from flax import nnx

        flat = {".".join(map(str, k)): np.asarray(v[...]) for k, v in nnx.to_flat_state(gathered[2])}
        counted = "pairs" if config.preference else "tokens"
        np.savez(os.path.join(out, f"{name}.npz"), loss=np.asarray(gathered[0]),
                 **{counted: np.asarray(gathered[1])}, **flat)


def main(model, out, port, process_id):
    for name in CASES:
        case(model, out, port, process_id, name)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
