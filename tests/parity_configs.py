"""Small research configs that together cover what the parity tests must exercise.

Between them: sliding / CSA / HCA layers, hash and routed MoE, hc_mult 4 and 2, the
official spelling (ratios 0/4/128) and the transformers spelling (other ratios, odd
window), and contexts long enough that CSA sparsity bites ((pos+1)//ratio > index_topk).
"""

_COMMON = {
    "model_type": "deepseek_v4",
    "vocab_size": 384,
    "num_key_value_heads": 1,
    "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus",
    "swiglu_limit": 10.0,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000,
    "compress_rope_theta": 160000,
    "max_position_embeddings": 65536,
    "num_nextn_predict_layers": 1,
    "torch_dtype": "float32",
}

PARITY_CONFIGS = {
    # transformers spelling: CSA 4 / HCA 16, one sliding layer, two hash layers, hc_mult 4.
    "mixed_hc4": {
        **_COMMON,
        "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "head_dim": 80,
        "qk_rope_head_dim": 16, "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 32,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
        "routed_scaling_factor": 1.5, "index_n_heads": 16, "index_head_dim": 32, "index_topk": 6,
        "sliding_window": 8, "hc_mult": 4,
        "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                        "compressed_sparse_attention"],
        "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe"],
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        "rope_parameters": {
            "main": {"rope_type": "default", "rope_theta": 10000},
            "compress": {"rope_type": "yarn", "rope_theta": 160000, "factor": 16,
                         "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
                         "attention_factor": 1.0},
        },
    },
    # Official spelling (ratios 0/4/128), hc_mult 2, HCA windows of 128 tokens.
    "official_hc2": {
        **_COMMON,
        "hidden_size": 48, "num_hidden_layers": 3, "num_attention_heads": 2, "head_dim": 64,
        "qk_rope_head_dim": 16, "q_lora_rank": 24, "o_groups": 2, "o_lora_rank": 16,
        "n_routed_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 40,
        "routed_scaling_factor": 2.5, "index_n_heads": 12, "index_head_dim": 32, "index_topk": 16,
        "sliding_window": 16, "hc_mult": 2, "num_hash_layers": 1,
        "compress_ratios": [128, 4, 0, 0],
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 4096,
                         "beta_fast": 32, "beta_slow": 1},
    },
    # transformers spelling with other ratios (CSA 8, HCA 32) and an odd window, hc_mult 2.
    "odd_ratios_hc2": {
        **_COMMON,
        "hidden_size": 40, "num_hidden_layers": 3, "num_attention_heads": 3, "head_dim": 48,
        "qk_rope_head_dim": 8, "q_lora_rank": 20, "o_groups": 3, "o_lora_rank": 12,
        "n_routed_experts": 5, "num_experts_per_tok": 3, "moe_intermediate_size": 24,
        "routed_scaling_factor": 1.0, "index_n_heads": 16, "index_head_dim": 16, "index_topk": 5,
        "sliding_window": 5, "hc_mult": 2,
        "layer_types": ["heavily_compressed_attention", "compressed_sparse_attention",
                        "compressed_sparse_attention"],
        "mlp_layer_types": ["hash_moe", "moe", "moe"],
        "compress_rates": {"compressed_sparse_attention": 8, "heavily_compressed_attention": 32},
        "rope_parameters": {
            "main": {"rope_type": "default", "rope_theta": 10000},
            "compress": {"rope_type": "yarn", "rope_theta": 160000, "factor": 8,
                         "original_max_position_embeddings": 2048, "beta_fast": 32, "beta_slow": 1,
                         "attention_factor": 1.0},
        },
    },
    # Official spelling, all CSA, no hash layers, hc_mult 4, larger top-k and window.
    "csa_only_hc4": {
        **_COMMON,
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 64,
        "qk_rope_head_dim": 32, "q_lora_rank": 32, "o_groups": 4, "o_lora_rank": 16,
        "n_routed_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 32,
        "routed_scaling_factor": 1.5, "index_n_heads": 16, "index_head_dim": 64, "index_topk": 12,
        "sliding_window": 24, "hc_mult": 4, "num_hash_layers": 0,
        "compress_ratios": [4, 4, 0],
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 4096,
                         "beta_fast": 32, "beta_slow": 1},
    },
}
