"""Stand-in for the per-buffer GK decode fork that seed 000 describes (not public): the public
parameter list with K_cache / V_cache optional, up to 18 per-buffer K_cache_buf_<j> / V_cache_buf_<j>
(buffer j holds layers 2j and 2j+1, picked by i // 2) and a second update index for the sliding
layers. "The kernel also accepts the stacked K_cache/V_cache and asserts exactly one form is
present; it reads the packed-FP8 path from the K buffer rank." """

from _checks import WEIGHTS, check_layer, kernel_assert, kv_update_on, layer, out_like


def gpt_oss_decode_mega_kernel(
    x_shard, input_layernorm_weight, W_qkv, bias_qkv, W_out, bias_out, sink, post_attn_layernorm_weight,
    router_weights, router_bias, expert_gate_up_weights, expert_down_weights, expert_gate_up_weights_scale,
    expert_down_weights_scale, expert_gate_up_bias, expert_down_bias, swa_start_pos_ids, cos, sin,
    active_blocks_table, active_blocks_table_swa, attention_mask, kv_cache_update_idx, pos_ids, pos_ids_swa,
    rank_id, tp_replica_group, ep_replica_group, num_layers, tp_size, ep_size, B_attn, S_tkg, top_k, eps,
    hidden_actual, softmax_scale, gate_clamp_upper_limit, up_clamp_upper_limit, up_clamp_lower_limit,
    k_scale=None, v_scale=None, K_cache=None, V_cache=None, kv_cache_update_idx_swa=None,
    K_cache_buf_0=None, K_cache_buf_1=None, K_cache_buf_2=None, K_cache_buf_3=None, K_cache_buf_4=None, K_cache_buf_5=None, K_cache_buf_6=None, K_cache_buf_7=None, K_cache_buf_8=None, K_cache_buf_9=None, K_cache_buf_10=None, K_cache_buf_11=None, K_cache_buf_12=None, K_cache_buf_13=None, K_cache_buf_14=None, K_cache_buf_15=None, K_cache_buf_16=None, K_cache_buf_17=None,
    V_cache_buf_0=None, V_cache_buf_1=None, V_cache_buf_2=None, V_cache_buf_3=None, V_cache_buf_4=None, V_cache_buf_5=None, V_cache_buf_6=None, V_cache_buf_7=None, V_cache_buf_8=None, V_cache_buf_9=None, V_cache_buf_10=None, V_cache_buf_11=None, V_cache_buf_12=None, V_cache_buf_13=None, V_cache_buf_14=None, V_cache_buf_15=None, V_cache_buf_16=None, V_cache_buf_17=None,
):
    w = {n: v for n, v in locals().items() if n in WEIGHTS}
    given = dict(locals())
    ks = [given[f"K_cache_buf_{j}"] for j in range(18) if given[f"K_cache_buf_{j}"] is not None]
    vs = [given[f"V_cache_buf_{j}"] for j in range(18) if given[f"V_cache_buf_{j}"] is not None]
    stacked = K_cache is not None or V_cache is not None
    kernel_assert(stacked != bool(ks or vs), "exactly one KV form: the stacked K_cache/V_cache or the per-buffer "
                                             "K_cache_buf_<j>/V_cache_buf_<j>")
    if stacked:
        raise AssertionError("this stand-in checks the per-buffer form only")
    groups = (num_layers + 1) // 2
    kernel_assert(len(ks) == len(vs) == groups, f"{groups} K/V buffers for {num_layers} layers, got "
                                                f"{len(ks)}/{len(vs)}")
    kernel_assert(kv_cache_update_idx_swa is not None, "kv_cache_update_idx_swa is required with per-buffer KV")
    packed = ks[0].ndim == vs[0].ndim + 1  # "packed-ness is inferred from k.dim() == v.dim() + 1"
    for i in range(num_layers):
        sliding = i % 2 == 0
        check_layer(x_shard, tp_size, ep_size, B_attn, S_tkg, i, num_layers, w, ks[i // 2], vs[i // 2],
                    active_blocks_table_swa if sliding else active_blocks_table, attention_mask,
                    kv_cache_update_idx_swa if sliding else kv_cache_update_idx, pos_ids_swa if sliding else pos_ids,
                    layer(swa_start_pos_ids, i, num_layers), cos, sin, rank_id, k_scale, v_scale, hidden_actual,
                    packed)
    if kv_update_on():
        return (out_like(x_shard), *ks, *vs)
    return out_like(x_shard)
