"""The names of everything in a run directory, in one place.

    RUN/run_config.json          the TrainConfig the run was started with (never rewritten by a resume)
    RUN/resumes.jsonl            one line per `--resume`: time, step resumed from, options changed [old, new]
    RUN/run_data.json            the tokens of --data and --eval-data (digest, counts) the run trains on
    RUN/base_source.json         the HF checkpoint --model was converted from, as its manifest records it
                                 (`"source"`, jaxmodel/formats/checkpoint.py); absent when it records none
    RUN/checkpoints/STEP/        Orbax checkpoints (LoRA, optimizer state, step, RNG, data position)
    RUN/damaged-checkpoints/     checkpoints a resume found damaged, moved aside (never deleted)
    RUN/metrics.jsonl            one line per logged step
    RUN/tensorboard/             TensorBoard event files
    RUN/.finetune-lock           the lock the running process holds (pid and host inside)

These names are a contract with runs already on disk: older runs resume and export with them unchanged.
"""

from jaxmodel.formats.markers import RUN_CONFIG  # how any tool recognises a run directory

RESUMES = "resumes.jsonl"
# {"step": when recorded (0: at the start), "data": {...}, "eval_data": {...}} (`finetune.data.prepare.RunData.record`:
# per file its path, the digest of its tokens, examples, tokens, the data's fingerprint, the tokenizer's digest).
RUN_DATA = "run_data.json"
# Written when a run starts (a resume keeps it; --model cannot change); export-peft names the base with it.
BASE_SOURCE = "base_source.json"
CHECKPOINTS = "checkpoints"
DAMAGED = "damaged-checkpoints"  # where a resume moves checkpoints that do not restore (kept, not deleted)
METRICS = "metrics.jsonl"
TENSORBOARD = "tensorboard"
LOCK_FILE = ".finetune-lock"
DELETING = ".finetune-deleting-"  # prefix of the directory an --overwrite moves the old run into, then deletes

__all__ = ["RUN_CONFIG", "RESUMES", "RUN_DATA", "BASE_SOURCE", "CHECKPOINTS", "DAMAGED", "METRICS", "TENSORBOARD", "LOCK_FILE",
           "DELETING"]
