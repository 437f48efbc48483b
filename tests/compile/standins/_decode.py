"""The body of the ``gpt_oss_decode_mega_kernel`` stand-ins: what the published sources do with
their arguments before any instruction is emitted, for each revision.

A = aws-neuron/nki-library@e9ef98fc, F = baonudesifeizhai/nki-library@9f2490f6, both
src/nkilib_src/nkilib/models/gpt_oss/c128_giga_kernel/experimental/gpt_oss/gpt_oss_decode_layer_dp_tp_ep.py:

- every stacked weight is indexed ``W[i]`` when its leading dim is num_layers, else ``W[0]``
  (A:874-891, F:1212-1229);
- K/V: A indexes ``K_cache[i]`` or ``K_cache[0]`` (A:880-881); F also takes ceil(L/2) entries, layer
  i reading ``K_cache[i // 2]`` (F:1222-1223);
- F's sliding layers write through ``kv_cache_update_idx_swa`` when it is given (F:1189);
- F's fused embedding (F:1042-1141) reshapes ``embed_ids`` to (T_shard*tp_size, 1) and reads
  x_shard's shape and dtype; its hidden form (embed_weight's last dim != H) also reshapes
  ``embed_x_shard_ids`` to (T_shard, 1); the ids are indirect-DMA offsets;
- F's fused RoPE (F:1150-1177) writes cos/sin tables of shape (d/2, B_attn, S_tkg) in cos.dtype and
  sin.dtype, reshaping inv_freq to (d/2, 1) and pos_ids to (1, B_attn*S_tkg);
- the KV write-back switch decides whether (x, K_cache, V_cache) or x is returned (A:945, F:1296);
- the collectives take ``tp_replica_group`` / ``ep_replica_group`` as ReplicaGroup objects
  (annotations A:692-693, F:828-829);
- the MoE multiplies the MXFP4 expert tiles with ``nki.isa.nc_matmul_mx``
  (core/moe/moe_tkg/gate_up_projection_mx.py ``_projection_matmul_mx``, in A and F);
- F's hidden-sharded embedding gathers [T_attn, H/tp] into one SBUF tile: "T_attn <= P_MAX"
  (F:1092-1100).
Each layer's view is then checked as ``_checks.check_layer`` does.
"""

import torch
from nki import isa
from nki.collectives import ReplicaGroup

from _checks import WEIGHTS, check_layer, dtype_name, kernel_assert

INT_IDS = ("int32", "uint32", "int64")


def make(paired: bool, kv_update, weights_check=None, mx_moe: bool = True, k_update=None, moe=None):
    """The body for one revision: ``paired`` (F's i // 2 entries), ``kv_update()`` reads the switch,
    ``weights_check(w)`` is what the revision's MoE modules assert of a layer's weights, ``mx_moe``
    whether its MoE multiplies the MX tiles with nc_matmul_mx (both published revisions do), after
    ``moe(weights, scales)`` (its ``validate_moe_block_inputs``); ``k_update(K)`` is the packed-K
    update's own FP8 tensor (``_k_update_fp8_packed``)."""

    def body(**a):
        x_shard, L, tp = a["x_shard"], a["num_layers"], a["tp_size"]
        B_attn, S = a["B_attn"], a["S_tkg"]
        T_shard, H = x_shard.shape
        for g in ("tp_replica_group", "ep_replica_group"):
            kernel_assert(isinstance(a[g], ReplicaGroup), f"{g} must be an nki.collectives.ReplicaGroup, got "
                                                         f"{type(a[g]).__name__}")
        if a.get("embed_weight") is not None:
            ew, t_attn = a["embed_weight"], T_shard * tp
            ids = a["embed_ids"].reshape((t_attn, 1))
            kernel_assert(dtype_name(ids) in INT_IDS, f"embed_ids are DMA offsets, got {ids.dtype}")
            if ew.shape[1] != H:
                rows = a["embed_x_shard_ids"].reshape((T_shard, 1))
                kernel_assert(dtype_name(rows) in INT_IDS, f"embed_x_shard_ids are DMA offsets, got {rows.dtype}")
                kernel_assert(ew.shape[1] * tp == H, f"all_gather of {tp} slices of {ew.shape[1]} lanes is not {H}")
                kernel_assert(t_attn <= 128, f"the hidden-sharded gather holds T_attn = {t_attn} rows in one SBUF tile "
                                             f"(partition dim at most 128)")
        cos, sin = a["cos"], a["sin"]
        if a.get("inv_freq") is not None:
            half = a["inv_freq"].shape[0]
            a["inv_freq"].reshape((half, 1))
            a["pos_ids"].reshape((1, B_attn * S))
            cos = torch.zeros((half, B_attn, S), dtype=cos.dtype)
            sin = torch.zeros((half, B_attn, S), dtype=sin.dtype)
        K, V = a["K_cache"], a["V_cache"]
        if K.ndim == 6 and k_update is not None:  # packed FP8 K: written through the kernel's own e4m3 view
            k_update(K)
        for i in range(L):
            sliding = i % 2 == 0
            w = {n: a[n][i if a[n].shape[0] == L else 0] for n in WEIGHTS}
            if weights_check is not None:
                weights_check(w)
            if mx_moe:  # MX tiles (as the kernel sees their dtype): the MoE's MX matmul
                moe(w["expert_gate_up_weights"], w["expert_gate_up_weights_scale"])
                isa.nc_matmul_mx(None, w["expert_gate_up_weights"], x_shard, w["expert_gate_up_weights_scale"], None)

            def entry(t):
                if t.shape[0] == L:
                    return i
                return 0 if (t.shape[0] == 1 or not paired) else i // 2

            Kl, Vl = K[entry(K)], V[entry(V)]
            upd = a["kv_cache_update_idx"]
            if paired and sliding and a.get("kv_cache_update_idx_swa") is not None:
                upd = a["kv_cache_update_idx_swa"]
            check_layer(x_shard, tp, a["ep_size"], B_attn, S, i, L, w, Kl, Vl,
                        a["active_blocks_table_swa" if sliding else "active_blocks_table"], a["attention_mask"], upd,
                        a["pos_ids_swa" if sliding else "pos_ids"], a["swa_start_pos_ids"][i], cos, sin,
                        a["rank_id"], a["k_scale"], a["v_scale"], a["hidden_actual"], K.ndim == 6)
        x = torch.zeros(tuple(x_shard.shape), dtype=x_shard.dtype)
        return (x, K, V) if kv_update() else x

    return body
