"""The Mixture-of-Experts models of mlx-lm's own model tests, and that file's model checks.

:data:`MODELS` reproduces, as data, every MoE configuration that mlx-lm 0.32.2's
``tests/test_models.py`` builds: the MoE entries of ``test_all_models`` (keyed
by model type), the per-architecture tests and the tests that build an MoE for
another purpose (keyed by test name, ``test_`` dropped). Each is
``(mlx-lm module, the arguments its ModelArgs gets there)``.

:func:`check_like_mlx_lm` repeats that file's ``model_test_runner`` checks on a
tiered model, each step run beside mlx-lm's resident model: a model cast after
load (``update`` with ``astype``, as the runner does), prompt caches, a batch of
two, ``copy.deepcopy``. Where mlx-lm's model computes, the tiered one must give
the same outputs; where it cannot (unquantized fp16 experts on MLX's CPU
backend), the tiered one must fail the same way.
"""

from __future__ import annotations

import copy
import importlib
from pathlib import Path

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_map
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import quantize_model

from mlx_tier.engine.checkpoint import open_checkpoint
from mlx_tier.engine.dtypes import cast_model
from mlx_tier.engine.load import TierConfig, tier_model
from support.checkpoints import write_checkpoint

SEED = 1234
# How a checkpoint is saved: float32; 4-bit (float32 scales); bf16 then 4-bit
# (bf16 scales: mlx-community's usual layout, as mlx_lm.convert --dtype bfloat16
# -q writes it). Quantized as mlx_lm.convert does (quantize_model).
KINDS = ("fp32", "q4", "bf16-q4")

MODELS = {
    "bailing_moe": ("bailing_moe", dict(
        model_type="bailing_moe", hidden_size=64, intermediate_size=128, max_position_embeddings=1000,
        moe_intermediate_size=128, num_experts=4, num_shared_experts=1, norm_topk_prob=True, num_attention_heads=4,
        num_experts_per_tok=2, num_hidden_layers=4, num_key_value_heads=2, rms_norm_eps=1e-05, rope_theta=1000,
        vocab_size=1000, first_k_dense_replace=2,
    )),
    "dots1": ("dots1", dict(
        model_type="dots1", hidden_size=64, num_hidden_layers=4, intermediate_size=128, num_attention_heads=4,
        rms_norm_eps=1e-05, vocab_size=1000, max_position_embeddings=None, num_key_value_heads=2,
        first_k_dense_replace=1, moe_intermediate_size=64, n_routed_experts=4, n_shared_experts=1,
        norm_topk_prob=True, num_experts_per_tok=1, rope_theta=1000, routed_scaling_factor=1.0,
    )),
    "ernie4_5_moe": ("ernie4_5_moe", dict(
        hidden_size=128, intermediate_size=128, model_type="ernie4_5_moe", max_position_embeddings=1000,
        num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4, rms_norm_eps=1e-05, vocab_size=1000,
        rope_theta=1000, use_bias=False, tie_word_embeddings=False, moe_num_experts=4,
    )),
    "glm4_moe": ("glm4_moe", dict(
        model_type="glm4_moe", vocab_size=1000, hidden_size=128, intermediate_size=128,
        max_position_embeddings=1000, moe_intermediate_size=128, norm_topk_prob=True, num_attention_heads=4,
        n_group=2, head_dim=32, topk_group=1, n_shared_experts=1, n_routed_experts=4, routed_scaling_factor=1.0,
        num_experts_per_tok=2, first_k_dense_replace=1, num_hidden_layers=4, num_key_value_heads=2,
        rms_norm_eps=1e-05, rope_theta=1000, rope_scaling=None, use_qk_norm=True, tie_word_embeddings=False,
        attention_bias=False, partial_rotary_factor=0.5,
    )),
    "glm4_moe_lite": ("glm4_moe_lite", dict(
        model_type="glm4_moe_lite", vocab_size=1000, hidden_size=64, intermediate_size=128,
        moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
        n_shared_experts=1, n_routed_experts=4, routed_scaling_factor=1.0, kv_lora_rank=8, q_lora_rank=8,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=8, topk_method="noaux_tc", scoring_func="sigmoid",
        norm_topk_prob=True, n_group=1, topk_group=1, num_experts_per_tok=2, moe_layer_freq=1,
        first_k_dense_replace=1, max_position_embeddings=256, rms_norm_eps=1e-05, rope_theta=1000,
        rope_scaling=None, attention_bias=False, partial_rotary_factor=1.0, tie_word_embeddings=False,
        num_nextn_predict_layers=1,
    )),
    "granitemoe": ("granitemoe", dict(
        model_type="granitemoe", hidden_size=128, num_hidden_layers=4, intermediate_size=128,
        num_attention_heads=4, rms_norm_eps=1e-05, vocab_size=1000, logits_scaling=1.0, attention_multiplier=1.0,
        embedding_multiplier=1.0, residual_multiplier=1.0, max_position_embeddings=1000, num_key_value_heads=2,
        attention_bias=False, rope_theta=1000, num_local_experts=4, num_experts_per_tok=2,
    )),
    "kimi_vl": ("kimi_vl", dict(
        text_config=dict(
            vocab_size=1000, hidden_size=128, intermediate_size=128, moe_intermediate_size=128,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, n_shared_experts=1,
            n_routed_experts=4, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16,
            qk_nope_head_dim=16,
        ),
        model_type="kimi_vl", num_hidden_layers=4, vocab_size=1000,
    )),
    "laguna": ("laguna", dict(
        model_type="laguna", vocab_size=10000, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-06, sliding_window=4,
        partial_rotary_factor=0.5, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
        shared_expert_intermediate_size=128, moe_routed_scaling_factor=2.5, moe_router_score_func="sqrtsoftplus",
        layer_types=["full_attention", "sliding_attention", "sliding_attention", "sliding_attention"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"], num_attention_heads_per_layer=[4, 4, 4, 4],
        rope_parameters=dict(
            full_attention=dict(
                rope_type="yarn", rope_theta=500000.0, factor=8.0, original_max_position_embeddings=4096,
                beta_slow=1.0, beta_fast=32.0, partial_rotary_factor=0.5,
            ),
            sliding_attention=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=1.0),
        ),
    )),
    "llama4": ("llama4", dict(
        model_type="llama4",
        text_config=dict(
            attention_bias=False, attention_chunk_size=8, head_dim=32, hidden_size=128,
            interleave_moe_layer_step=2, intermediate_size=128, intermediate_size_mlp=128,
            max_position_embeddings=1000, model_type="llama4", num_attention_heads=4, num_experts_per_tok=1,
            num_hidden_layers=4, num_key_value_heads=2, num_local_experts=2, rms_norm_eps=0.0001,
            rope_scaling=None, rope_theta=1000, use_qk_norm=True, vocab_size=1000,
        ),
        num_hidden_layers=4, vocab_size=1000,
    )),
    "longcat_flash_ngram": ("longcat_flash_ngram", dict(
        model_type="longcat_flash_ngram", attention_method="MLA", zero_expert_type="identity", hidden_size=128,
        ffn_hidden_size=128, moe_topk=2, expert_ffn_hidden_size=128, n_routed_experts=2, zero_expert_num=2,
        num_layers=4, num_hidden_layers=4, vocab_size=1000, max_position_embeddings=1000, num_attention_heads=4,
        kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        routed_scaling_factor=1.0, rms_norm_eps=1e-05, rope_theta=1000, mla_scale_q_lora=True,
        mla_scale_kv_lora=True, attention_bias=False,
    )),
    "longcat_flash": ("longcat_flash", dict(
        model_type="longcat_flash", attention_method="MLA", zero_expert_type="identity", hidden_size=128,
        ffn_hidden_size=128, moe_topk=2, expert_ffn_hidden_size=128, n_routed_experts=2, zero_expert_num=2,
        num_layers=4, num_hidden_layers=4, vocab_size=1000, max_position_embeddings=1000, num_attention_heads=4,
        kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        routed_scaling_factor=1.0, rms_norm_eps=1e-05, rope_theta=1000, mla_scale_q_lora=True,
        mla_scale_kv_lora=True, attention_bias=False,
    )),
    "olmoe": ("olmoe", dict(
        model_type="olmoe", hidden_size=128, num_hidden_layers=4, intermediate_size=128, num_attention_heads=2,
        rms_norm_eps=1e-05, vocab_size=1000, num_experts=4, num_experts_per_tok=2,
    )),
    "qwen3_vl_moe": ("qwen3_vl_moe", dict(
        model_type="qwen3_vl_moe",
        text_config=dict(
            model_type="qwen3_moe", hidden_size=128, num_hidden_layers=4, intermediate_size=256,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-05, head_dim=32, vocab_size=1000,
            decoder_sparse_step=1, mlp_only_layers=[], num_experts_per_tok=2, num_experts=4,
            moe_intermediate_size=128, rope_theta=1000, max_position_embeddings=1000, tie_word_embeddings=False,
            norm_topk_prob=True,
        ),
        num_hidden_layers=4, vocab_size=1000,
    )),
    "Klear": ("Klear", dict(
        model_type="Klear", hidden_size=128, num_hidden_layers=4, intermediate_size=128, num_attention_heads=4,
        attention_bias=False, mlp_only_layers=[0], num_experts=4, num_experts_per_tok=2, decoder_sparse_step=2,
        n_shared_experts=1, moe_intermediate_size=128, rms_norm_eps=1e-05, vocab_size=1000, num_key_value_heads=4,
        rope_theta=1000.0, max_position_embeddings=1000, norm_topk_prob=True,
    )),
    "granitemoehybrid": ("granitemoehybrid", dict(
        model_type="granitemoehybrid", vocab_size=1000, hidden_size=128, intermediate_size=128,
        num_hidden_layers=4, max_position_embeddings=1000, num_attention_heads=8, num_key_value_heads=4,
        attention_bias=False, embedding_multiplier=1.0, attention_multiplier=1.0, logits_scaling=1.0,
        residual_multiplier=1.0, num_local_experts=8, num_experts_per_tok=2, shared_intermediate_size=128,
        mamba_n_heads=8, mamba_d_head=16, mamba_proj_bias=False, mamba_d_state=128, mamba_d_conv=4,
        mamba_n_groups=1, mamba_conv_bias=False, layer_types=["mamba", "attention", "mamba", "attention"],
        rms_norm_eps=1e-05, rope_theta=1000.0,
    )),
    "jamba": ("jamba", dict(
        model_type="jamba", hidden_size=128, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_offset=1, attn_layer_period=2, expert_layer_offset=1,
        expert_layer_period=2, mamba_d_conv=4, mamba_d_state=128, mamba_expand=128, num_experts=4,
        num_experts_per_tok=2, rms_norm_eps=1e-05, max_position_embeddings=1000, vocab_size=1000,
    )),
    "minimax": ("minimax", dict(
        model_type="minimax", hidden_size=128, intermediate_size=128, num_attention_heads=8, num_key_value_heads=8,
        max_position_embeddings=1000, num_experts_per_tok=2, num_local_experts=8, shared_intermediate_size=128,
        num_hidden_layers=4, rms_norm_eps=0.0001, rope_theta=1000, rotary_dim=16, vocab_size=1000,
    )),
    "bailing_moe_linear": ("bailing_moe_linear", dict(
        model_type="bailing_moe_linear", hidden_size=1024, num_hidden_layers=4, intermediate_size=2048,
        moe_intermediate_size=1024, num_experts_per_tok=2, num_experts=4, norm_topk_prob=True,
        num_shared_experts=2, num_attention_heads=4, num_key_value_heads=4, rms_norm_eps=1e-05, vocab_size=10000,
        rope_theta=1000, first_k_dense_replace=0, layer_group_size=2, group_norm_size=1,
        max_position_embeddings=1000,
    )),
    "bailing_hybrid": ("bailing_hybrid", dict(
        model_type="bailing_hybrid", hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, num_experts=8, num_experts_per_tok=2,
        num_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1, layer_group_size=2,
        group_norm_size=4, vocab_size=1000, rms_norm_eps=1e-05, rope_theta=1000, max_position_embeddings=1000,
        routed_scaling_factor=2.5, head_dim=64, kv_lora_rank=64, q_lora_rank=96, qk_rope_head_dim=16,
        qk_nope_head_dim=32, v_head_dim=32, rope_interleave=True, partial_rotary_factor=0.5, use_qk_norm=True,
        score_function="sigmoid", norm_topk_prob=True, moe_router_enable_expert_bias=True,
    )),
    "qwen3_next": ("qwen3_next", dict(
        model_type="qwen3_next", hidden_size=128, num_hidden_layers=4, intermediate_size=128,
        num_attention_heads=8, num_key_value_heads=4, vocab_size=1000, linear_num_value_heads=4,
        linear_num_key_heads=4, linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=3,
        num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, shared_expert_intermediate_size=128,
        mlp_only_layers=[0], moe_intermediate_size=128, rms_norm_eps=1e-05, head_dim=64, rope_theta=1000.0,
        partial_rotary_factor=0.5, max_position_embeddings=1000,
    )),
    "qwen3_5_moe": ("qwen3_5_moe", dict(
        model_type="qwen3_5_moe", hidden_size=128, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, vocab_size=1000, linear_num_value_heads=4, linear_num_key_heads=4,
        linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=3, num_experts=4,
        num_experts_per_tok=2, shared_expert_intermediate_size=128, moe_intermediate_size=128, rms_norm_eps=1e-05,
        head_dim=64, rope_theta=1000.0, partial_rotary_factor=0.5, max_position_embeddings=1000,
    )),
    "kimi_linear": ("kimi_linear", dict(
        model_type="kimi_linear", vocab_size=1000, hidden_size=128, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, intermediate_size=128, head_dim=32, rope_theta=100.0, rms_norm_eps=1e-06,
        linear_attn_config=dict(num_heads=8, head_dim=32, kda_layers=[1]), model_max_length=1000, num_experts=2,
        moe_intermediate_size=128, kv_lora_rank=8, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
    )),
    "kimi_k3": ("kimi_k3", dict(
        model_type="kimi_k3", vocab_size=1000, num_hidden_layers=4,
        text_config=dict(
            model_type="kimi_linear", vocab_size=1000, hidden_size=64, num_hidden_layers=4, num_attention_heads=2,
            num_key_value_heads=2, intermediate_size=96, rms_norm_eps=1e-05, hidden_act="situ",
            activation_situ_beta=4.0, activation_situ_linear_beta=25.0,
            linear_attn_config=dict(
                kda_layers=[1, 2, 3], full_attn_layers=[4], num_heads=2, head_dim=32, short_conv_kernel_size=4,
                gate_lower_bound=-5.0, use_full_rank_gate=True,
            ),
            num_experts=8, moe_intermediate_size=32, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=16, mla_use_nope=True, mla_use_output_gate=True,
            num_experts_per_token=2, num_shared_experts=1, first_k_dense_replace=1, routed_expert_hidden_size=32,
            latent_moe_use_norm=True, attn_res_block_size=2,
        ),
    )),
    "afmoe": ("afmoe", dict(
        model_type="afmoe", vocab_size=1000, hidden_size=128, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, intermediate_size=128, head_dim=32, rope_theta=100.0,
        layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"], num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=128,
    )),
    "deepseek_v32": ("deepseek_v32", dict(
        model_type="deepseek_v32", vocab_size=1024, hidden_size=128, intermediate_size=256,
        moe_intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        n_routed_experts=4, n_group=2, topk_group=1, num_experts_per_tok=2, n_shared_experts=1, kv_lora_rank=4,
        q_lora_rank=4, qk_rope_head_dim=32, v_head_dim=16, qk_nope_head_dim=32,
        rope_scaling=dict(
            beta_fast=32, beta_slow=1, factor=40, mscale=1.0, mscale_all_dim=1.0,
            original_max_position_embeddings=4096, type="yarn",
        ),
    )),
    "mimo_v2_flash": ("mimo_v2_flash", dict(
        model_type="mimo_v2_flash", num_experts_per_tok=2, hybrid_layer_pattern=[0, 1, 0, 1],
        moe_layer_freq=[0, 1, 0, 1], add_swa_attention_sink_bias=True, add_full_attention_sink_bias=False,
        sliding_window_size=32, vocab_size=1000, hidden_size=512, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, n_shared_experts=1, n_routed_experts=8,
        routed_scaling_factor=None, topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True, n_group=2,
        topk_group=1, max_position_embeddings=1000, layernorm_epsilon=1e-05, rope_theta=1000.0,
        swa_rope_theta=1000.0, swa_num_attention_heads=4, swa_num_key_value_heads=2, head_dim=128, v_head_dim=64,
        swa_head_dim=128, swa_v_head_dim=64, partial_rotary_factor=0.5, attention_value_scale=0.707,
    )),
    "exaone_moe": ("exaone_moe", dict(
        model_type="exaone_moe", vocab_size=1000, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4,
        num_experts_per_tok=2, num_shared_experts=1, n_group=1, topk_group=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, sliding_window=32, max_position_embeddings=1000, rms_norm_eps=1e-05,
        rope_theta=1000.0,
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
        is_moe_layer=[False, True, True, True], tie_word_embeddings=False,
    )),
    "minimax_m3_vl": ("minimax_m3_vl", dict(
        model_type="minimax_m3_vl", vocab_size=128, num_hidden_layers=4,
        text_config=dict(
            model_type="minimax_m3_vl", vocab_size=128, hidden_size=64, intermediate_size=32,
            dense_intermediate_size=64, shared_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, rotary_dim=8, num_local_experts=4, num_experts_per_tok=2,
            moe_layer_freq=[0, 0, 1, 1], rms_norm_eps=1e-05, rope_theta=1000.0, max_position_embeddings=1000,
        ),
    )),
    "bailing_moe_v3": ("bailing_moe_v3", dict(
        vocab_size=64, hidden_size=32, intermediate_size=32, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=32, num_hidden_layers=4, num_attention_heads=2, num_experts=4,
        num_experts_per_tok=2, num_shared_experts=1, n_group=2, topk_group=1, layer_group_size=4, head_dim=32,
        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=32,
    )),
    "deepseek_v3": ("deepseek_v3", dict(
        model_type="deepseek_v3", vocab_size=1024, hidden_size=128, intermediate_size=256,
        moe_intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        n_routed_experts=4, n_group=2, topk_group=1, num_experts_per_tok=2, n_shared_experts=1, kv_lora_rank=4,
        q_lora_rank=4, qk_rope_head_dim=32, v_head_dim=16, qk_nope_head_dim=32,
        rope_scaling=dict(
            beta_fast=32, beta_slow=1, factor=40, mscale=1.0, mscale_all_dim=1.0,
            original_max_position_embeddings=4096, type="yarn",
        ),
    )),
    "deepseek_v41": ("deepseek_v41", dict(
        model_type="deepseek_v41", vocab_size=128, hidden_size=64, num_hidden_layers=6, num_attention_heads=4,
        head_dim=32, q_lora_rank=32, qk_rope_head_dim=8, o_groups=2, o_lora_rank=16, moe_intermediate_size=32,
        n_routed_experts=8, num_experts_per_tok=2, sliding_window=4, compress_ratios=(0, 2, 2, 2, 1, 1),
        kv_source_layer_ids=(1, 4), index_source_layer_ids=(1, 2, 4, 5), index_n_heads=4, index_head_dim=32,
        index_topk=3, candidate_source_layer_id=4, candidate_topk_blocks=2, candidate_block_size=2,
    )),
    "gpt_oss": ("gpt_oss", dict(
        model_type="gpt_oss", hidden_size=1024, num_hidden_layers=4, intermediate_size=2048, num_attention_heads=8,
        num_key_value_heads=2, num_local_experts=16, num_experts_per_tok=2, sliding_window=128, rope_theta=10000,
        vocab_size=10000,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    )),
    "hunyuan": ("hunyuan", dict(
        model_type="hunyuan", hidden_size=128, attention_bias=False, intermediate_size=256, num_attention_heads=4,
        num_hidden_layers=4, num_key_value_heads=2, rms_norm_eps=0.0001, rope_theta=1000, vocab_size=1000,
        moe_topk=2, num_experts=2, num_shared_expert=1, use_mixed_mlp_moe=True, use_qk_norm=True,
        rope_scaling=dict(alpha=1000.0, factor=1.0, type="dynamic"), use_cla=True, cla_share_factor=2,
    )),
    "lfm2_moe": ("lfm2_moe", dict(
        model_type="lfm2_moe", hidden_size=1024, intermediate_size=7168, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, norm_eps=1e-05, vocab_size=10000, full_attn_idxs=[0, 1, 2],
        rope_theta=10000, max_position_embeddings=1000, conv_bias=True, conv_L_cache=3, moe_intermediate_size=1792,
        num_dense_layers=2, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, use_expert_bias=True,
    )),
    "mistral4": ("mistral4", dict(
        model_type="mistral4", vocab_size=1024, hidden_size=128, intermediate_size=256, moe_intermediate_size=256,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, n_routed_experts=4, n_group=2,
        topk_group=1, num_experts_per_tok=2, n_shared_experts=1, routed_scaling_factor=1.0, kv_lora_rank=4,
        q_lora_rank=4, qk_rope_head_dim=32, v_head_dim=16, qk_nope_head_dim=32, norm_topk_prob=True,
        max_position_embeddings=4096, rms_norm_eps=1e-06, first_k_dense_replace=0,
        rope_parameters=dict(
            rope_type="yarn", factor=128.0, mscale=1.0, mscale_all_dim=1.0, beta_fast=32, beta_slow=1,
            original_max_position_embeddings=4096, rope_theta=100000.0, llama_4_scaling_beta=0.1,
        ),
    )),
    "mixtral": ("mixtral", dict(
        model_type="mixtral", vocab_size=100, hidden_size=32, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_experts_per_tok=2, num_key_value_heads=2, num_local_experts=4,
    )),
    "phimoe": ("phimoe", dict(
        model_type="phimoe", vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4,
        rope_scaling=dict(
            long_factor=[1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
            long_mscale=1.243163121016122, original_max_position_embeddings=4096,
            short_factor=[1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
            short_mscale=1.243163121016122, type="longrope",
        ),
    )),
    "phixtral": ("phixtral", dict(
        model_type="phixtral", num_vocab=100, model_dim=64, num_heads=4, num_layers=2, rotary_dim=16,
        num_experts_per_tok=2, num_local_experts=4,
    )),
    "qwen2_moe": ("qwen2_moe", dict(
        model_type="qwen2_moe", hidden_size=1024, num_hidden_layers=4, intermediate_size=2048,
        num_attention_heads=4, rms_norm_eps=1e-05, vocab_size=10000, num_experts_per_tok=4, num_experts=16,
        moe_intermediate_size=1024, shared_expert_intermediate_size=2048,
    )),
    "qwen3_moe": ("qwen3_moe", dict(
        model_type="qwen3_moe", hidden_size=1024, num_hidden_layers=4, intermediate_size=2048,
        num_attention_heads=4, num_key_value_heads=4, rms_norm_eps=1e-05, head_dim=128, vocab_size=10000,
        decoder_sparse_step=1, mlp_only_layers=[], num_experts_per_tok=4, num_experts=16,
        moe_intermediate_size=1024, rope_theta=1000, max_position_embeddings=4096, tie_word_embeddings=False,
        norm_topk_prob=True,
    )),
    "step3p5": ("step3p5", dict(
        model_type="step3p5", hidden_size=256, num_hidden_layers=4, vocab_size=1024, num_attention_heads=4,
        num_attention_groups=2, head_dim=64, intermediate_size=512, rms_norm_eps=1e-05,
        rope_theta=[10000.0, 10000.0, 10000.0, 10000.0], sliding_window=64,
        layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
        partial_rotary_factors=[0.5, 1.0, 1.0, 0.5],
        attention_other_setting=dict(num_attention_heads=8, num_attention_groups=2), use_head_wise_attn_gate=True,
        moe_num_experts=4, moe_top_k=2, moe_intermediate_size=256, share_expert_dim=256, moe_layers_enum="1,2,3",
    )),
    "gemma4_moe_router_quantizes_to_8bit": ("gemma4", dict(
        model_type="gemma4", vocab_size=64,
        text_config=dict(
            model_type="gemma4_text", hidden_size=64, num_hidden_layers=1, intermediate_size=128,
            moe_intermediate_size=128, num_attention_heads=1, num_key_value_heads=1, num_global_key_value_heads=1,
            head_dim=64, global_head_dim=64, sliding_window=8, sliding_window_pattern=1,
            layer_types=["full_attention"], hidden_size_per_layer_input=0, num_kv_shared_layers=0,
            tie_word_embeddings=True, enable_moe_block=True, num_experts=8, top_k_experts=2,
        ),
    )),
    "gemma4_raw_hf_moe_expert_weights_split_for_switch_glu": ("gemma4", dict(
        model_type="gemma4", vocab_size=32,
        text_config=dict(
            model_type="gemma4_text", hidden_size=8, num_hidden_layers=1, intermediate_size=16,
            num_attention_heads=1, num_key_value_heads=1, num_global_key_value_heads=1, head_dim=8,
            global_head_dim=8, sliding_window=8, sliding_window_pattern=1, layer_types=["full_attention"],
            hidden_size_per_layer_input=0, num_kv_shared_layers=0, tie_word_embeddings=True, enable_moe_block=True,
            num_experts=2, top_k_experts=1, moe_intermediate_size=3,
        ),
    )),
    "klear_sanitize_sparse_step": ("Klear", dict(
        model_type="Klear", hidden_size=32, num_hidden_layers=4, intermediate_size=64, num_attention_heads=4,
        attention_bias=False, mlp_only_layers=[], num_experts=4, num_experts_per_tok=2, decoder_sparse_step=2,
        n_shared_experts=1, moe_intermediate_size=64, rms_norm_eps=1e-05, vocab_size=128, num_key_value_heads=2,
        rope_theta=1000.0, max_position_embeddings=512, norm_topk_prob=True,
    )),
    "laguna_sanitize": ("laguna", dict(
        model_type="laguna", vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
        layer_types=["full_attention", "sliding_attention"], mlp_layer_types=["dense", "sparse"],
    )),
    "llama4_chunked_kv_cache": ("llama4", dict(
        model_type="llama4", vocab_size=1000, num_hidden_layers=4,
        text_config=dict(
            attention_bias=False, attention_chunk_size=4, head_dim=32, hidden_size=128,
            interleave_moe_layer_step=2, intermediate_size=128, intermediate_size_mlp=128,
            max_position_embeddings=1000, model_type="llama4", num_attention_heads=4, num_experts_per_tok=1,
            num_hidden_layers=4, num_key_value_heads=2, num_local_experts=2, rms_norm_eps=0.0001,
            rope_scaling=None, rope_theta=1000, use_qk_norm=True, vocab_size=1000,
        ),
    )),
    "qwen3_moe_sanitize_sparse_step": ("qwen3_moe", dict(
        model_type="qwen3_moe", hidden_size=32, num_hidden_layers=4, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-05, head_dim=8, vocab_size=128, decoder_sparse_step=2,
        mlp_only_layers=[], num_experts_per_tok=2, num_experts=4, moe_intermediate_size=64, rope_theta=1000,
        max_position_embeddings=512, tie_word_embeddings=False, norm_topk_prob=True,
    )),
    "qwen3_next_sanitize_sparse_step": ("qwen3_next", dict(
        model_type="qwen3_next", hidden_size=32, num_hidden_layers=4, intermediate_size=64, num_attention_heads=4,
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=2,
        shared_expert_intermediate_size=64, mlp_only_layers=[], moe_intermediate_size=64, rms_norm_eps=1e-05,
        vocab_size=128, num_key_value_heads=2, rope_theta=1000.0, partial_rotary_factor=0.25,
        max_position_embeddings=512, head_dim=8,
    )),
    "step3p5_make_cache_uses_fallback_sliding_pattern": ("step3p5", dict(
        model_type="step3p5", hidden_size=256, num_hidden_layers=5, vocab_size=1024, num_attention_heads=4,
        num_attention_groups=2, head_dim=64, intermediate_size=512, rms_norm_eps=1e-05, rope_theta=10000.0,
        sliding_window=4, partial_rotary_factors=[1.0, 1.0, 1.0, 1.0, 1.0], use_head_wise_attn_gate=True,
        moe_num_experts=4, moe_top_k=2, moe_intermediate_size=256, share_expert_dim=256, moe_layers_enum="1,2,3,4",
    )),
    "step3p5_make_cache_uses_rotating_for_sliding_layers": ("step3p5", dict(
        model_type="step3p5", hidden_size=256, num_hidden_layers=4, vocab_size=1024, num_attention_heads=4,
        num_attention_groups=2, head_dim=64, intermediate_size=512, rms_norm_eps=1e-05,
        rope_theta=[10000.0, 10000.0, 10000.0, 10000.0], sliding_window=4,
        layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
        partial_rotary_factors=[0.5, 1.0, 1.0, 0.5],
        attention_other_setting=dict(num_attention_heads=8, num_attention_groups=2), use_head_wise_attn_gate=True,
        moe_num_experts=4, moe_top_k=2, moe_intermediate_size=256, share_expert_dim=256, moe_layers_enum="1,2,3",
    )),
    "bailing_moe_v3_flash": ("bailing_moe_v3", dict(
        vocab_size=64, hidden_size=32, intermediate_size=32, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=32, num_hidden_layers=4, num_attention_heads=2, num_experts=4,
        num_experts_per_tok=2, num_shared_experts=1, n_group=2, topk_group=1, layer_group_size=4, head_dim=32,
        q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=32,
    )),
}


def build(name: str) -> tuple[nn.Module, dict]:
    """mlx-lm's model for ``MODELS[name]``, seeded, and the config.json that loads it again."""
    module_name, args = MODELS[name]
    module = importlib.import_module(f"mlx_lm.models.{module_name}")
    mx.random.seed(SEED)
    model = module.Model(module.ModelArgs.from_dict(args))
    return model, {**args, "model_type": module_name}


def load_tiered(path: Path, config: TierConfig) -> nn.Module:
    """The model ``mlx_tier.load(path, config=config)`` returns, without its tokenizer
    (as ``mlx_lm.utils.load_model`` is ``mlx_lm.load``'s model): transformers refuses
    some of these configs when it reads them for the tokenizer (dots1's
    ``max_position_embeddings=None``), and the tokenizer plays no part here."""
    checkpoint = open_checkpoint(path)
    tier_model(checkpoint.model, path, config, checkpoint.index)
    return checkpoint.model


def save(path: Path, name: str, kind: str, tokenizer_dir: Path, group_size: int = 32) -> Path:
    """``MODELS[name]`` saved with mlx-lm's ``save_model`` as ``kind`` (one of
    :data:`KINDS`), quantized at ``group_size``: 32 quantizes the experts of more
    of these tiny models than 64 would (``quantize_model`` leaves a layer whose
    width is not a multiple of the group unquantized). Where mlx-lm's
    ``quantize_model`` itself fails at 32 (a model's own rule asks group 64 of a
    32-wide router), the checkpoint is quantized at 64, as it allows."""
    for group in dict.fromkeys((group_size, 64)):
        model, config = build(name)
        if kind == "bf16-q4":
            cast_model(model, mx.bfloat16)
        if kind == "fp32":
            break
        try:
            model, config = quantize_model(model, config, group, 4)
            break
        except ValueError:  # "[quantize] The last dimension ... divisible by ... group size 64"
            if group == 64:
                raise
    return write_checkpoint(path, model, config, tokenizer_dir)


def vocab_size(model: nn.Module) -> int:
    return model(mx.array([[0]])).shape[-1]


def _outcome(fn) -> tuple[str, mx.array | None]:
    """``("ok", evaluated output)`` or ``("error: <message>", None)``."""
    try:
        out = fn()
        mx.eval(out)
        return "ok", out
    except RuntimeError as e:  # MLX cannot compute it (e.g. fp16 gather_mm on the CPU backend)
        return f"error: {e}", None


def _step(models: dict, fn, shape: tuple, dtype) -> dict:
    """Run ``fn(model)`` on both models; the tiered one does what mlx-lm's does.

    Returns:
        name -> output (empty when mlx-lm's model could not compute it).
    """
    got = {name: _outcome(lambda m=m: fn(m)) for name, m in models.items()}
    assert got["tiered"][0] == got["mlx-lm"][0], {name: how for name, (how, _) in got.items()}
    if got["mlx-lm"][0] != "ok":
        return {}
    want, out = got["mlx-lm"][1], got["tiered"][1]
    assert out.shape == want.shape == shape and out.dtype == want.dtype == dtype
    assert mx.array_equal(out, want).item(), float(mx.abs(out - want).max())
    return {name: o for name, (_, o) in got.items()}


def check_like_mlx_lm(tiered: nn.Module, resident: nn.Module, name: str) -> None:
    """mlx-lm's ``model_test_runner`` on ``tiered``, each step also run on
    ``resident`` (mlx-lm's model of the same checkpoint) and compared bitwise."""
    models = {"tiered": tiered, "mlx-lm": resident}
    vocab = vocab_size(resident)
    assert len(tiered.layers) == len(resident.layers) and tiered.model_type == resident.model_type, name
    for t in (mx.float32, mx.float16):
        for m in models.values():  # as the runner casts: floating parameters, packed weights left alone
            m.update(tree_map(lambda p: p.astype(t) if mx.issubdtype(p.dtype, mx.floating) else p, m.parameters()))
        inputs = mx.array([[0, 1]])
        _step(models, lambda m: m(inputs), (1, 2, vocab), t)
        caches = {id(m): make_prompt_cache(m) for m in models.values()}
        prompt = _step(models, lambda m: m(inputs, cache=caches[id(m)]), (1, 2, vocab), t)
        if prompt:
            last = {id(m): mx.argmax(prompt[k][0, -1:, :], keepdims=True) for k, m in models.items()}
            _step(models, lambda m: m(last[id(m)], cache=caches[id(m)]), (1, 1, vocab), t)
    _step(models, lambda m: m(mx.array([[0, 1], [2, 3]])), (2, 2, vocab), mx.float16)
    check_copy(tiered)


def check_copy(model: nn.Module) -> None:
    """``copy.deepcopy`` gives a model that computes what the original does, with
    slabs, counters and a cold tier of its own."""
    twin = copy.deepcopy(model)
    x = mx.array([[3, 1, 4, 1, 5]])
    a, b = _outcome(lambda: model(x)), _outcome(lambda: twin(x))
    assert a[0] == b[0] and (a[1] is None or mx.array_equal(a[1], b[1]).item())
    assert twin.expert_cache.store is not model.expert_cache.store
    assert twin.expert_cache.layers[0] is not model.expert_cache.layers[0]
    assert twin.expert_cache.layers[0].owner is twin.expert_cache
