"""Every on-disk format the tools share, below all of them so that each tool can read another's output:

- `hf_names`: the one table between HF tensor names and this port's parameter paths;
- `hf_checkpoint`: HF checkpoint directories (safetensors, sharded + index, torch `.bin`) and their aux files;
- `safetensors_file`: safetensors headers at the byte level (streaming writes at known offsets);
- `checkpoint` / `checkpoint_writer`: the converted checkpoint (manifest, checksums, verify; the writer);
- `peft_adapter`: PEFT LoRA adapter directories, both ways;
- `markers`: what a directory is (HF checkpoint, converted checkpoint, run, adapter);
- `atomic`, `io`: directories that appear whole or not at all (stale temporaries of killed writers cleared);
  positioned writes and chunked reads;
- `output_dir`: the one rule for every directory a tool writes (what it may replace, what never).
"""
