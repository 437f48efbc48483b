"""Stand-in for the public ``gpt_oss_decode_mega_kernel`` (stacked K_cache / V_cache): its
parameter list, in order, with its defaults, and the assertions its source makes."""

from _checks import WEIGHTS, check_layer, kernel_assert, kv_update_on, layer, out_like



def gpt_oss_decode_mega_kernel(
    x_shard, input_layernorm_weight, W_qkv, bias_qkv, W_out, bias_out, sink, K_cache, V_cache,
    post_attn_layernorm_weight, router_weights, router_bias, expert_gate_up_weights, expert_down_weights,
    expert_gate_up_weights_scale, expert_down_weights_scale, expert_gate_up_bias, expert_down_bias,
    swa_start_pos_ids, cos, sin, active_blocks_table, active_blocks_table_swa, attention_mask, kv_cache_update_idx,
    pos_ids, pos_ids_swa, rank_id, tp_replica_group, ep_replica_group, num_layers, tp_size, ep_size, B_attn, S_tkg,
    top_k, eps, hidden_actual, softmax_scale, gate_clamp_upper_limit, up_clamp_upper_limit, up_clamp_lower_limit,
    k_scale=None, v_scale=None,
):
    w = {n: v for n, v in locals().items() if n in WEIGHTS}
    packed = K_cache.ndim == 6  # "Packed fp8 KV: stacked K_cache is 6D"
    if kv_update_on():
        # "each layer writes its own K_cache[li_k] slice, so caches MUST be stacked per-layer"
        kernel_assert(K_cache.shape[0] == num_layers and V_cache.shape[0] == num_layers,
                      f"KV update needs caches stacked per layer: leading dims {K_cache.shape[0]}/{V_cache.shape[0]}, "
                      f"num_layers {num_layers}")
    for i in range(num_layers):
        sliding = i % 2 == 0
        check_layer(x_shard, tp_size, ep_size, B_attn, S_tkg, i, num_layers, w, layer(K_cache, i, num_layers),
                    layer(V_cache, i, num_layers), active_blocks_table_swa if sliding else active_blocks_table,
                    attention_mask, kv_cache_update_idx, pos_ids_swa if sliding else pos_ids,
                    layer(swa_start_pos_ids, i, num_layers), cos, sin, rank_id, k_scale, v_scale, hidden_actual,
                    packed)
    if kv_update_on():
        return out_like(x_shard), K_cache, V_cache
    return out_like(x_shard)
