"""The tiny mixture of experts the mesh tests train (tests/test_moe_families.py), on one process and on two
(tests/multihost_worker.py's "moe" case)."""

# demo/tiny.py's model as a Qwen3-MoE: 4 experts, 2 a token, layer 1 dense; the load-balancing loss weighed enough to
# move the gradients
TINY_MOE = {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "mlp_only_layers": [1], "norm_topk_prob": True, "router_aux_loss_coef": 0.1}
# its LoRA targets there: attention, the dense layer's MLP, the router (and so the load-balancing loss) and the experts
MOE_MESH_TARGETS = "q_proj,down_proj,gate,experts.gate_up_proj,experts.down_proj"
