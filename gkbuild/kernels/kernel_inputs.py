"""What a runtime hands the Neuron programs, built from the twins' step inputs and checked
against the manifest's per-rank signature (names, shapes, dtypes) before anything runs.

The twins keep one replica's control in their own form (``decode.Control``: [B] int64 positions,
-1 for an inactive row's update slot, tables padded with block 0). The published kernel takes:
cos/sin [d/2, B_attn, 1]; int32 block tables with -1 in the slots a row does not use (the kernel
skips their DMA); uint32 update slots, uint32 max for a row that writes nothing; float32 positions
[B_attn, 1] and per-layer window starts [L, B_attn, 1]; the uint8 active-token mask [1, B_attn, q, 1];
``rank_id`` [1, 1] uint32; the FP8 quantize multipliers [1, 1]. With several KV heads a rank, tables
and slots are per head in "num_blocks * kv_heads addressing" (block b of head h is b * kv + h).
x_shard and cos/sin are passed in every form: with the fused embedding or RoPE the kernel reads
only their shapes and dtypes, so they are zeros.
"""

from __future__ import annotations

import numpy as np
import torch

from ..compile.signature import UINT32_SKIP
from ..errors import GkError
from ..layout import embedding as embedding_layout
from .decode import Control


def embed_ids(embedding: dict, tokens: torch.Tensor, rank: int, tp: int, dp: int):
    """What rank ``rank``'s fused-embedding prologue takes for this step's ``tokens`` [B]:
    ``embed_ids`` [B_attn] int32 (vocab: local to the TP rank's rows, -1 where another TP rank owns
    the id; hidden: global) and, for hidden, ``embed_x_shard_ids`` [T_shard] int32 (else None)."""
    rows_attn = tokens.shape[0] // dp
    replica, t = rank // tp, rank % tp
    mine = tokens[replica * rows_attn:(replica + 1) * rows_attn].numpy()
    if embedding["placement"] == "vocab":
        return embedding_layout.local_ids(mine, t, embedding["rows_per_rank"]), None
    return mine.astype(np.int32), embedding_layout.x_shard_ids(t, rows_attn // tp)


def decode_given(m: dict, rank: int, tokens: torch.Tensor, ctl: Control, weights: dict, kv_args: dict,
                 host_embed: torch.Tensor | None = None) -> dict:
    """Every input of rank ``rank``'s decode program for one step, by name: the embedded x_shard
    (decode.embedding host, from ``host_embed``) or the fused embedding's ids, the rank's weights
    and KV arguments, and the step's controls."""
    t, cfg = m["topology"], m["model"]
    B, hp = tokens.shape[0], m["scalars"]["hidden_padded"]
    T = B // t["world_size"]
    emb = m["layout"]["embedding"]
    given = {**weights, **kv_args}
    if emb["placement"] == "host":
        given["x_shard"] = host_embed[tokens[rank * T:(rank + 1) * T]].to(torch.bfloat16)
    else:
        given["x_shard"] = torch.zeros(T, hp, dtype=torch.bfloat16)
        ids, rows = embed_ids(emb, tokens, rank, t["tp"], t["dp"])
        given["embed_ids"] = torch.from_numpy(ids)
        if rows is not None:
            given["embed_x_shard_ids"] = torch.from_numpy(rows)
    given.update(decode_controls(ctl, m["layout"]["kv"]["block_size"], max(1, cfg["num_key_value_heads"] // t["tp"]),
                                 cfg["num_attention_heads"] // t["tp"], rank, cfg["head_dim"]))
    return given


def _table(ids: torch.Tensor, used: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, n] block ids (the first ``used[b]`` slots live) -> int32, -1 in the unused slots,
    per head ``[B, kv, n]`` when a rank holds several heads."""
    live = torch.arange(ids.shape[1])[None, :] < used[:, None]
    t = torch.where(live, ids, torch.full_like(ids, -1))
    if kv_heads > 1:
        h = torch.arange(kv_heads)[None, :, None]
        t = torch.where(t[:, None, :] >= 0, t[:, None, :] * kv_heads + h, torch.full_like(t[:, None, :], -1))
    return t.to(torch.int32)


def _slots(idx: torch.Tensor, block: int, kv_heads: int) -> torch.Tensor:
    """[B] flat slots (-1: inactive) -> uint32 [B, 1] (or [B, kv, 1]), uint32 max = skip."""
    if kv_heads > 1:
        b, off = torch.div(idx, block, rounding_mode="floor"), idx % block
        h = torch.arange(kv_heads)[None, :]
        s = torch.where(idx[:, None] >= 0, (b[:, None] * kv_heads + h) * block + off[:, None],
                        torch.full((idx.shape[0], kv_heads), -1, dtype=idx.dtype))
        s = s[..., None]
    else:
        s = idx[:, None]
    return torch.where(s >= 0, s, torch.full_like(s, UINT32_SKIP)).to(torch.uint32)


def decode_controls(ctl: Control, block: int, kv_heads: int, q_heads: int, rank: int, head_dim: int) -> dict:
    """The decode kernel's control inputs for one rank of the replica ``ctl`` describes."""
    pos, pos_swa = ctl.pos, ctl.pos_swa
    active = ctl.update_idx >= 0
    out = {
        "swa_start_pos_ids": ctl.swa_start.to(torch.float32)[..., None],
        "active_blocks_table": _table(ctl.block_table, pos // block + 1, kv_heads),
        "active_blocks_table_swa": _table(ctl.block_table_swa, pos_swa // block + 1, kv_heads),
        "attention_mask": active.to(torch.uint8)[None, :, None, None].expand(1, -1, q_heads, 1).contiguous(),
        "kv_cache_update_idx": _slots(ctl.update_idx, block, kv_heads),
        "kv_cache_update_idx_swa": _slots(ctl.update_idx_swa, block, kv_heads),
        "pos_ids": pos.to(torch.float32)[:, None],
        "pos_ids_swa": pos_swa.to(torch.float32)[:, None],
        "rank_id": torch.tensor([[rank]], dtype=torch.uint32),
    }
    if ctl.cos is not None:  # host RoPE
        out["cos"] = ctl.cos.T.contiguous()[..., None].to(torch.float32)
        out["sin"] = ctl.sin.T.contiguous()[..., None].to(torch.float32)
    else:  # fused RoPE: the kernel writes its own tables in cos/sin's dtype
        out["cos"] = out["sin"] = torch.zeros(head_dim // 2, pos.shape[0], 1, dtype=torch.float32)
    return out


def assemble(inputs: list[dict], given: dict, program: str) -> list[torch.Tensor]:
    """The program's inputs in signature order, each checked against its manifest entry; a
    ``constant`` comes from the manifest. One line names the first input that does not fit."""
    out = []
    for i in inputs:
        if i["kind"] == "constant":
            t = torch.full(i["shape"], i["value"], dtype=getattr(torch, i["dtype"]))
        elif i["name"] in given:
            t = given[i["name"]]
        else:
            raise GkError(f"{program}: no value for its input {i['name']!r}")
        if list(t.shape) != list(i["shape"]) or t.dtype != getattr(torch, i["dtype"], None):
            raise GkError(f"{program}: input {i['name']} is {str(t.dtype).removeprefix('torch.')}{list(t.shape)}, the "
                          f"program takes {i['dtype']}{i['shape']}")
        out.append(t)
    return out
