"""The assertions the published decode kernel makes on one layer's view, shared by the decode
stand-ins of every revision (``attention_block_tkg._validate_and_extract_config``,
``attention_tkg._setup_block_kv_cache`` and the MoE block's ``rank_id``, as aws-neuron/nki-library
@e9ef98fc has them; F calls the same blocks).

``kernel_assert`` raises AssertionError with the source's message, as the NKI tracer does.
"""

import torch

FP8_E4M3 = ("float8_e4m3", "float8_e4m3fn")  # is_fp8_e4m3: either variant
# the per-layer weights the mega kernel stacks on a leading layer axis
WEIGHTS = ("input_layernorm_weight", "W_qkv", "bias_qkv", "W_out", "bias_out", "sink", "post_attn_layernorm_weight",
           "router_weights", "router_bias", "expert_gate_up_weights", "expert_down_weights",
           "expert_gate_up_weights_scale", "expert_down_weights_scale", "expert_gate_up_bias", "expert_down_bias")


def kernel_assert(cond, msg):
    if not cond:
        raise AssertionError(msg)


def dtype_name(t) -> str:
    return str(t.dtype).removeprefix("torch.")


def check_layer(X_shard, tp_size, ep_size, B_attn, S_tkg, i, num_layers, w, K, V, table, mask, upd, pos, swa_start,
                cos, sin, rank_id, k_scale, v_scale, hidden_actual, packed):
    """One layer's attention_block_tkg + moe_block checks (block KV, pos_ids given)."""
    T_shard, H = X_shard.shape
    kernel_assert(T_shard * tp_size == B_attn * S_tkg, f"AllGather[TP] of {T_shard} x {tp_size} rows does not reshape "
                                                       f"to B_attn={B_attn} x S_tkg={S_tkg}")
    B = B_attn
    gamma, W_qkv = w["input_layernorm_weight"], w["W_qkv"]
    kernel_assert(tuple(gamma.shape) == (1, H), f"rmsnorm_X_gamma must be (1, {H}), got {tuple(gamma.shape)}")
    d_head = V.shape[-1]
    I = W_qkv.shape[1]
    k_base = 4 if packed else 3
    kernel_assert(K.ndim in (k_base, k_base + 1), f"K_cache must have {k_base} or {k_base + 1} dimensions, got {K.ndim}")
    kernel_assert(V.ndim in (3, 4), f"V_cache must have 3 or 4 dimensions, got {V.ndim}")
    k_head, v_head = K.ndim == k_base + 1, V.ndim == 4
    kernel_assert(k_head == v_head, "K_cache and V_cache must agree on the kv-head dimension")
    kv_heads = K.shape[1] if k_head else 1
    if k_head:
        kernel_assert(K.shape[1] == V.shape[1], "K_cache and V_cache kv_heads mismatch")
    kernel_assert(d_head % 2 == 0, f"d_head must be even, got {d_head}")
    kernel_assert(I % d_head == 0, f"QKV weights must be packed as (q_heads + 2) * d_head, got I={I}")
    q_heads = I // d_head - 2 * kv_heads
    Kf = K.reshape((K.shape[0] * kv_heads,) + tuple(K.shape[2:])) if k_head else K
    Vf = V.reshape((V.shape[0] * kv_heads,) + tuple(V.shape[2:])) if v_head else V
    blk_len = Vf.shape[1]
    if kv_heads > 1:
        kernel_assert(table.ndim == 3 and table.shape[0] == B and table.shape[1] == kv_heads,
                      f"Block KV active_blocks_table must be [B_attn, kv_heads, num_blocks], got {tuple(table.shape)}")
    else:
        kernel_assert(table.ndim == 2 and table.shape[0] == B,
                      f"Block KV requires active_blocks_table (bs, num_blocks_per_batch), got {tuple(table.shape)}")
    # attention_tkg prints a WARNING for a non-int32 table (int32 with -1 marks unused slots for
    # DMA skipping); a stand-in cannot print past a test, so it refuses.
    kernel_assert(dtype_name(table) == "int32", f"active_blocks_table dtype is {dtype_name(table)}, not int32")
    if packed:
        kernel_assert(tuple(Kf.shape) == (Vf.shape[0], blk_len // 2, Vf.shape[2], 2),
                      f"Block KV fp8_packed shape mismatch: K={tuple(Kf.shape)}")
        kernel_assert(dtype_name(K) in FP8_E4M3, f"Block KV fp8_packed requires float8_e4m3 K_cache, got {K.dtype}")
    else:
        kernel_assert(tuple(Vf.shape) == tuple(Kf.shape), f"Block KV cache shape mismatch: K={tuple(Kf.shape)} "
                                                          f"vs V={tuple(Vf.shape)}")
    kernel_assert(tuple(pos.shape) == (B, S_tkg), f"pos_ids shape mismatch: expected ({B}, {S_tkg}), got "
                                                  f"{tuple(pos.shape)}")
    kernel_assert(tuple(mask.shape) == (S_tkg, B, q_heads, S_tkg),
                  f"attention_mask shape mismatch: expected {(S_tkg, B, q_heads, S_tkg)}, got {tuple(mask.shape)}")
    kernel_assert(tuple(swa_start.shape) == (B, S_tkg), f"swa_start_pos_ids shape mismatch: expected ({B}, {S_tkg}), "
                                                        f"got {tuple(swa_start.shape)}")
    half = cos.shape[0]
    for name, t in (("cos", cos), ("sin", sin)):
        kernel_assert(tuple(t.shape) == (half, B, S_tkg) and 0 < half <= d_head // 2,
                      f"{name} shape mismatch: expected (rotary_half<={d_head // 2}, {B}, {S_tkg}), got {tuple(t.shape)}")
    want_upd = (B, kv_heads, S_tkg) if kv_heads > 1 else (B, S_tkg)
    kernel_assert(tuple(upd.shape) == want_upd, f"kv_cache_update_idx must be {want_upd}, got {tuple(upd.shape)}")
    kernel_assert(dtype_name(upd) == "uint32", f"kv_cache_update_idx must be uint32 (uint32 max = skip), got "
                                               f"{dtype_name(upd)}")
    if k_scale is not None and v_scale is not None:
        kernel_assert(dtype_name(K) in FP8_E4M3, f"KV quantization requires float8_e4m3 K_cache, got {K.dtype}")
        kernel_assert(dtype_name(V) in FP8_E4M3, f"KV quantization requires float8_e4m3 V_cache, got {V.dtype}")
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            kernel_assert(tuple(s.shape) in ((128, 1), (1, 1)), f"{name} must be (PMAX, 1) or (1, 1)")
        kernel_assert(dtype_name(X_shard) != "float32", "float32 query dtype is not supported with FP8 KV cache")
    kernel_assert(0 < hidden_actual <= H, f"hidden_actual {hidden_actual} must be in (0, {H}]")
    kernel_assert(tuple(rank_id.shape) == (1, 1) and dtype_name(rank_id) == "uint32",
                  f"rank_id must be [1, 1] uint32, got {tuple(rank_id.shape)} {dtype_name(rank_id)}")
    gu = w["expert_gate_up_weights"]
    kernel_assert(gu.shape[-2] == H // 512, f"expert gate_up H/512 tiles {gu.shape[-2]} != {H // 512}")
    return q_heads


def out_like(x):
    return torch.zeros(tuple(x.shape), dtype=x.dtype)
