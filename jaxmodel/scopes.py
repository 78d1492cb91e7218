"""The model's parts as `jax.named_scope` names: every op of a compiled step carries the part it computes in its
metadata's `op_name` (e.g. `jit(train_step)/while/body/closed_call/transpose(jvp())/.../rope/mul`), forward,
recomputation and gradient alike; an op inside two parts (LoRA in a projection) belongs to the inner one.
bench/step_profile.py groups a profile's op times by them."""

from __future__ import annotations

EMBEDDING = "embedding"
RMS_NORM = "rms_norm"
PROJECTION = "projection"  # a Linear: its matmul with the frozen (or quantized) weight, bias, casts and reshapes
LORA = "lora"  # a LoRA branch (inside a projection's scope, or the LM head's)
ROPE = "rope"
ATTENTION = "attention"  # scores, mask, softmax and the values' weighted sum, without the projections
SWIGLU = "swiglu"
# one block of an experts' grouped matmul (jaxmodel/moe.py), run or skipped as its rows are routed: the plan counts
# the share a balanced routing runs (finetune/planning/hlo_cost.py)
EXPERT_BLOCK = "expert_block"
# an expert-parallel dispatch's choice of its rows' bound (jaxmodel/moe.py): the plan counts the first bound's branch,
# which a balanced routing takes
EXPERT_DISPATCH = "expert_dispatch"
LM_HEAD = "lm_head"  # the head's logits and the loss over them (with the head's LoRA, if any)
OPTIMIZER = "optimizer"

# what each part is called in a table, in the order of the layer's computation
PARTS = {EMBEDDING: "embedding", RMS_NORM: "RMSNorm", PROJECTION: "projections", LORA: "LoRA", ROPE: "RoPE",
         ATTENTION: "attention", SWIGLU: "SwiGLU", EXPERT_BLOCK: "experts' blocks",
         EXPERT_DISPATCH: "experts' dispatch", LM_HEAD: "LM head and loss", OPTIMIZER: "optimizer"}
# the parts only a mixture of experts' step has (the dispatch's only under expert parallelism)
EXPERT_PARTS = (EXPERT_BLOCK, EXPERT_DISPATCH)
