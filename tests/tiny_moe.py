"""The tiny mixture of experts the mesh tests train (tests/test_moe_families.py), on one process and on two
(tests/multihost_worker.py's "moe" case)."""

# demo/tiny.py's model as a Qwen3-MoE: 4 experts, 2 a token, layer 1 dense; the load-balancing loss weighed enough to
# move the gradients
TINY_MOE = {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "mlp_only_layers": [1], "norm_topk_prob": True, "router_aux_loss_coef": 0.1}
# its LoRA targets there: attention, the dense layer's MLP, the router (and so the load-balancing loss) and the experts
MOE_MESH_TARGETS = "q_proj,down_proj,gate,experts.gate_up_proj,experts.down_proj"

# demo/tiny.py's model as a DeepSeek-V3: latent attention (a query bottleneck, YaRN, interleaved rotary pairs), layer 0
# dense, layer 1 8 routed experts in 4 groups (the best 2 kept), 2 a token, scaled, and a shared expert
TINY_DEEPSEEK = {"model_type": "deepseek_v3", "num_key_value_heads": 4, "first_k_dense_replace": 1,
                 "n_routed_experts": 8, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 2,
                 "moe_intermediate_size": 32, "n_shared_experts": 1, "norm_topk_prob": True,
                 "routed_scaling_factor": 2.5, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
                 "qk_rope_head_dim": 8, "head_dim": 8, "v_head_dim": 16, "rope_interleave": True,
                 "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                     "original_max_position_embeddings": 256, "mscale": 1.0, "mscale_all_dim": 0.8}}
# its LoRA targets there: every latent projection, the dense layer's and the shared expert's MLP, the routed experts
DEEPSEEK_MESH_TARGETS = ("q_a_proj,q_b_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj,gate_proj,down_proj,"
                         "experts.gate_up_proj,experts.down_proj")
