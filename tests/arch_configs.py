"""Tiny configs, one per mlx-lm MoE model type, for the architecture matrix.

Dimensions are as small as each architecture allows; E experts, top-K.
"""

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=512,
            tie_word_embeddings=False, head_dim=16)
E, K, MI = 8, 2, 32
CONFIGS = {
 "mixtral": dict(num_local_experts=E, num_experts_per_tok=K),
 "phimoe": dict(num_local_experts=E, num_experts_per_tok=K),
 "qwen2_moe": dict(num_experts=E, num_experts_per_tok=K, moe_intermediate_size=MI, shared_expert_intermediate_size=48),
 "qwen3_moe": dict(num_experts=E, num_experts_per_tok=K, moe_intermediate_size=MI, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True),
 "olmoe": dict(num_experts=E, num_experts_per_tok=K),
 "deepseek": dict(n_routed_experts=E, num_experts_per_tok=K, moe_intermediate_size=MI, n_shared_experts=1, first_k_dense_replace=1, num_hidden_layers=3),
 "deepseek_v2": dict(rope_scaling={"type": "yarn", "factor": 1.0, "original_max_position_embeddings": 512, "beta_fast": 32, "beta_slow": 1, "mscale": 1, "mscale_all_dim": 0}, n_routed_experts=E, num_experts_per_tok=K, moe_intermediate_size=MI, n_shared_experts=1, first_k_dense_replace=1, num_hidden_layers=3,
                     kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, n_group=1, topk_group=1),
 "deepseek_v3": dict(n_routed_experts=E, num_experts_per_tok=K, moe_intermediate_size=MI, n_shared_experts=1, first_k_dense_replace=1, num_hidden_layers=3,
                     kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, n_group=2, topk_group=1),
 "glm4_moe": dict(n_routed_experts=E, num_experts_per_tok=K, moe_intermediate_size=MI, n_shared_experts=1, first_k_dense_replace=1, num_hidden_layers=3,
                  norm_topk_prob=True, n_group=1, topk_group=1, routed_scaling_factor=1.0, rope_scaling=None, use_qk_norm=True, attention_bias=False, partial_rotary_factor=0.5),
 "gpt_oss": dict(num_local_experts=E, num_experts_per_tok=K, intermediate_size=64, sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
 "granitemoe": dict(num_local_experts=E, num_experts_per_tok=K, logits_scaling=1.0, attention_multiplier=0.25, embedding_multiplier=1.0, residual_multiplier=1.0, attention_bias=False),
 "ernie4_5_moe": dict(moe_num_experts=E, moe_k=K, moe_intermediate_size=MI, use_bias=False, moe_layer_start_index=1, moe_num_shared_experts=1),
 "bailing_moe": dict(num_experts=E, num_experts_per_tok=K, moe_intermediate_size=MI, num_shared_experts=1, norm_topk_prob=True, first_k_dense_replace=1, topk_group=1),
 "lfm2_moe": dict(num_experts=E, num_experts_per_tok=K, moe_intermediate_size=MI, norm_topk_prob=True, use_expert_bias=True, num_dense_layers=1, norm_eps=1e-5,
                  conv_bias=False, conv_L_cache=3, full_attn_idxs=[1], num_hidden_layers=2),
 "afmoe": dict(num_experts=E, num_experts_per_tok=K, moe_intermediate_size=MI, num_shared_experts=1, num_dense_layers=1, layer_types=["full_attention", "sliding_attention"], sliding_window=8, mup_enabled=False),
 "exaone_moe": dict(num_experts=E, num_experts_per_tok=K, moe_intermediate_size=MI, num_shared_experts=1, sliding_window=8,
                    layer_types=["full_attention", "sliding_attention"], is_moe_layer=[False, True]),
 "qwen3_next": dict(num_experts=E, num_experts_per_tok=K, moe_intermediate_size=MI, decoder_sparse_step=1, mlp_only_layers=[], shared_expert_intermediate_size=48,
                    linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                    partial_rotary_factor=0.25, full_attention_interval=2, norm_topk_prob=True),
}
