"""The DI transfer plan: a pure function of a build's ``layout/kv.json`` and the prefill's TP degree.

The prefill side is seed 000's native per-layer engine (vLLM's hybrid KV manager): every prefill
rank holds ``kv_heads / prefill_tp`` heads and allocates each layer pair j (sliding layer 2j, full
layer 2j+1) as one buffer ``[2, num_blocks, kv_p, block, d]`` (K half, V half), and registers one
region for each buffer's K and one for its V; block b of a region sits at ``b * block_len``
(``block_len = kv_p * block * d * itemsize``). A pair's two layers draw DISJOINT block ids from one
pool: the sliding group's and the full group's. K is written token-major ``[kv_p, block, d]``.

The decode side is the build: its K and V tensors ``[entries, num_blocks, kv, block, d]`` (the
kv.json ``di_regions``: one region per entry's K and V, block b at ``offset + b * block_len``).

For each decode rank, layer and half the plan names the prefill region it reads and, per
contiguous run of kv heads, the prefill rank, the byte offset inside a prefill block, the byte
offset inside the decode block and the length. For a pair (decode block d, prefill block p) of a
request the bytes are::

    decode:  region offset + d * decode block_len + decode_offset
    prefill: (region registered on its own)  p * prefill block_len + prefill_offset

Which block pairs a request moves (``block_pairs``): a full layer every block of the N-1 computed
positions; a sliding layer only the blocks of the window its first decode query (at N-1) attends:
positions ``max(0, N - W) .. N - 2``. Both roles operate at N-1 (``SWA_RULE``).
"""

from __future__ import annotations

import numpy as np

from ..errors import GkError, shown
from ..layout.kv import SWA_DI_TRUNCATION, table_of

HALVES = ("K", "V")
MAX_RANKS = 1 << 16
MAX_HEADS = 1 << 12

# How both roles apply the SWA N-1 rule (seed 000's NeuronNixlConnectorScheduler fix, kv.json's
# ``swa_di_truncation``), stated for a prompt of N tokens and a window of W positions.
SWA_RULE = {
    "truncate": True,
    "prefill": "computes and keeps K/V of positions 0..N-2 (N-1 tokens); hands over its full group's blocks "
               "0..(N-2)//block and its sliding group's last ceil(W/block)+1 blocks",
    "decode": "admits the request with N-1 computed tokens; its first step feeds token N-1 at position N-1 and "
              "writes that token's K/V itself; a sliding layer reads positions max(0, N-W)..N-2, so the "
              "transfer moves the sliding blocks max(0, N-W)//block..(N-2)//block",
    "why": SWA_DI_TRUNCATION,
}

PACKED_K = {
    "from": "[kv, block, d] token-major, as the prefill's per-layer engine writes K: token t, channel c at byte "
            "(t*d + c)",
    "to": "[kv, block/2, d, 2], what the decode kernel's fp8_packed path reads and writes: token t, channel c at "
          "byte ((t//2)*d + c)*2 + t%2 (even tokens in the low byte of a bf16 row, odd in the high byte)",
    "where": "on the decode side, after every READ of a request has completed and before its first decode step: "
             "each received K block is relaid in place (gkbuild.layout.kv.pack_block); V is never packed",
    "why": "no byte run longer than one byte is common to the two orders, so NIXL byte copies cannot reorder them",
    "source": "aws-neuron/nki-library@e9ef98fc47b3323bf0de8ebcc984b8e2f3adff07 src/nkilib_src/nkilib/models/gpt_oss/"
              "c128_giga_kernel/experimental/transformer/attention_block_tkg.py:268-270 (the last axis packs two "
              "consecutive positions), :2454-2457 and :2527-2601 (_k_update_fp8_packed: slot s in row s >> 1, "
              "byte 2c + (s & 1))",
}


def _heads_of_ranks(doc: dict) -> tuple[list[list[int]], int]:
    """Each decode rank's kv heads (kv.json ``kv_heads_of_rank``) and the model's kv head count."""
    raw = doc.get("kv_heads_of_rank")
    if not isinstance(raw, dict) or not 0 < len(raw) <= MAX_RANKS:
        raise GkError(f"kv.json: kv_heads_of_rank is {shown(raw)}; expected a map of rank -> kv heads")
    world = len(raw)
    heads = []
    for r in range(world):
        h = raw.get(str(r))
        if not isinstance(h, list) or len(h) != doc["kv_heads"] or \
                not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < MAX_HEADS for x in h):
            raise GkError(f"kv.json: kv_heads_of_rank[{r}] is {shown(h)}; expected {doc['kv_heads']} kv head indices")
        heads.append(h)
    total = max(max(h) for h in heads) + 1
    if sorted({x for h in heads for x in h}) != list(range(total)):
        raise GkError(f"kv.json: kv_heads_of_rank does not cover kv heads 0..{total - 1}")
    return heads, total


def prefill_heads(rank: int, prefill_tp: int, kv_heads: int) -> list[int]:
    """The kv heads prefill rank ``rank`` holds: a contiguous 1/prefill_tp of them, or one head
    replicated over prefill_tp / kv_heads ranks when the prefill TP exceeds the kv heads."""
    if prefill_tp <= kv_heads:
        n = kv_heads // prefill_tp
        return list(range(rank * n, (rank + 1) * n))
    return [rank * kv_heads // prefill_tp]


def _source(head: int, prefill_tp: int, kv_heads: int) -> tuple[int, int]:
    """(prefill rank, head position in its blocks) of a kv head: the first rank that holds it."""
    if prefill_tp <= kv_heads:
        n = kv_heads // prefill_tp
        return head // n, head % n
    return -(-head * prefill_tp // kv_heads), 0


def segments(heads: list[int], prefill_tp: int, kv_heads: int, head_bytes: int) -> list[dict]:
    """Contiguous reads that fill one decode block holding ``heads`` (in its order) from the
    prefill ranks' blocks: runs of consecutive heads in one prefill rank merge."""
    out: list[dict] = []
    for j, h in enumerate(heads):
        p, pos = _source(h, prefill_tp, kv_heads)
        last = out[-1] if out else None
        if last and last["prefill_rank"] == p and last["_next"] == (pos, j):
            last["length"] += head_bytes
            last["_next"] = (pos + 1, j + 1)
            continue
        out.append({"prefill_rank": p, "prefill_offset": pos * head_bytes, "decode_offset": j * head_bytes,
                    "length": head_bytes, "_next": (pos + 1, j + 1)})
    for s in out:
        del s["_next"]
    return out


def transfer_plan(doc: dict, prefill_tp: int, window: int) -> dict:
    """The plan for a build whose kv.json is ``doc`` (checked whole:
    ``layout.validate.kv``), a prefill engine of ``prefill_tp`` ranks and a sliding window of ``window``
    positions. JSON-ready."""
    if isinstance(prefill_tp, bool) or not isinstance(prefill_tp, int) or not 0 < prefill_tp <= MAX_RANKS:
        raise GkError(f"--prefill-tp {shown(prefill_tp)}: expected a positive integer")
    heads, K = _heads_of_ranks(doc)
    if not (K % prefill_tp == 0 or prefill_tp % K == 0):
        raise GkError(f"--prefill-tp {prefill_tp}: the model's {K} kv heads split over neither {prefill_tp} prefill "
                      f"ranks nor replicate evenly onto them")
    L, bl, d, it = doc["num_layers"], doc["block_size"], doc["head_dim"], doc["itemsize"]
    head_bytes = bl * d * it
    kv_p = len(prefill_heads(0, prefill_tp, K))
    buffers = -(-L // 2)
    regions = doc["di_regions"]
    entry_of = {x["layer"]: x["entry"] for x in doc["layers"]}
    prefill_regions = [{"index": 2 * j + h, "buffer": j, "half": half, "tensor": f"buffer[{j}][{h}]",
                        "layers": [i for i in (2 * j, 2 * j + 1) if i < L], "block_len": kv_p * head_bytes}
                       for j in range(buffers) for h, half in enumerate(HALVES)]
    ranks = []
    for r, hs in enumerate(heads):
        segs = segments(hs, prefill_tp, K, head_bytes)
        reads = []
        for i in range(L):
            for h, half in enumerate(HALVES):
                di = 2 * entry_of[i] + h
                reads.append({"layer": i, "half": half, "group": table_of(i), "decode_region": di,
                              "decode_region_offset": regions[di]["offset"], "prefill_region": 2 * (i // 2) + h,
                              "segments": [dict(s) for s in segs]})
        ranks.append({"rank": r, "kv_heads": hs, "reads": reads})
    return {
        "format": "gkbuild-di-plan-1",
        "decode": {"form": doc["form"], "entries": doc["entries"], "num_layers": L, "num_blocks": doc["num_blocks"],
                   "kv_heads_per_rank": doc["kv_heads"], "block_size": bl, "head_dim": d, "dtype": doc["dtype"],
                   "itemsize": it, "packed": doc["packed"], "block_len": doc["block_bytes"], "world_size": len(heads),
                   "regions": regions, "block_pool": doc["block_pool"]},
        "prefill": {"tp": prefill_tp, "kv_heads": K, "kv_heads_per_rank": kv_p, "buffers": buffers,
                    "block_len": kv_p * head_bytes, "dtype": doc["dtype"], "itemsize": it,
                    "layout": "a buffer [2, num_blocks, kv_p, block, d] a layer pair j (layers 2j, 2j+1): K half "
                              "then V half, K token-major; each half registered as its own region",
                    "heads_of_rank": [prefill_heads(p, prefill_tp, K) for p in range(prefill_tp)],
                    "regions": prefill_regions,
                    "block_pool": "one pool of num_blocks ids a rank (every rank the same ids); a pair's sliding "
                                  "layer draws from the sliding group, its full layer from the full group: "
                                  "disjoint ids"},
        "window": window,
        "offsets": {"decode": "decode_region_offset + decode_block * decode block_len + segment decode_offset",
                    "prefill": "prefill_block * prefill block_len + segment prefill_offset (in the prefill "
                               "region, registered on its own)"},
        "swa": dict(SWA_RULE),
        "k_conversion": dict(PACKED_K) if doc["packed"] else None,
        "ranks": ranks,
    }


# -- which blocks a request moves ---------------------------------------------------------------
def window_blocks(computed: int, block: int, window: int, truncate: bool = True) -> range:
    """Logical blocks a sliding layer reads at the decode's first query, for a request whose
    first ``computed`` (= N-1) positions were prefilled. ``truncate``: the N-1 rule (the first
    query is at N-1); without it the window is taken for a query at N, one position later."""
    if computed <= 0:
        return range(0)
    query = computed if truncate else computed + 1
    return range(max(0, query - window + 1) // block, (computed - 1) // block + 1)


def group_blocks(group: str, computed: int, block: int, window: int, truncate: bool = True) -> range:
    """Logical blocks a layer of ``group`` moves for a request with ``computed`` prefilled
    positions: a full layer every one of them, a sliding layer the window's (``window_blocks``)."""
    if group == "full":
        return range(-(-computed // block))
    return window_blocks(computed, block, window, truncate)


def block_pairs(group: str, computed: int, block: int, window: int, decode_ids: dict, prefill_ids: dict,
                truncate: bool = True) -> np.ndarray:
    """[n, 2] (decode block id, prefill block id) a layer of ``group`` moves for one request.
    ``decode_ids`` / ``prefill_ids``: {"full": [id per logical block], "swa": {logical block: id}}."""
    lbs = group_blocks(group, computed, block, window, truncate)
    out = np.empty((len(lbs), 2), dtype=np.int64)
    for k, lb in enumerate(lbs):
        ids = _id(decode_ids[group], lb), _id(prefill_ids[group], lb)
        if None in ids:
            side = "decode" if ids[0] is None else "prefill"
            raise GkError(f"the {side} side holds no {group} block for logical block {lb} of a request with "
                          f"{computed} computed positions")
        out[k] = ids
    return out


def _id(ids, lb: int):
    """Block id of logical block ``lb`` in a list (every block) or a {logical: id} map (a window)."""
    if isinstance(ids, dict):
        return ids.get(lb)
    return ids[lb] if 0 <= lb < len(ids) else None


def descriptors(plan: dict, rank: int, pairs: dict[str, np.ndarray]) -> np.ndarray:
    """Every read of one decode rank for one request: int64 rows (half, decode byte offset from
    the rank's K/V tensor base, prefill rank, prefill region, byte offset in that region,
    length). ``pairs``: ``block_pairs`` by group."""
    dl, pl = plan["decode"]["block_len"], plan["prefill"]["block_len"]
    rows = []
    for rd in plan["ranks"][rank]["reads"]:
        bp = pairs[rd["group"]]
        if not len(bp):
            continue
        h = HALVES.index(rd["half"])
        for s in rd["segments"]:
            n = len(bp)
            rows.append(np.stack([np.full(n, h), rd["decode_region_offset"] + bp[:, 0] * dl + s["decode_offset"],
                                  np.full(n, s["prefill_rank"]), np.full(n, rd["prefill_region"]),
                                  bp[:, 1] * pl + s["prefill_offset"], np.full(n, s["length"])], axis=1))
    return np.concatenate(rows) if rows else np.empty((0, 6), dtype=np.int64)


def shortfall(plan: dict, rank: int, pairs: dict[str, np.ndarray], computed: int) -> str | None:
    """What one request's reads on decode rank ``rank`` miss of what the run requires, or None:
    for each layer's K and V, every block of its group (``group_blocks``) whole, the decode
    block's ``block_len`` bytes."""
    d = plan["decode"]
    for rd in plan["ranks"][rank]["reads"]:
        want = len(group_blocks(rd["group"], computed, d["block_size"], plan["window"], plan["swa"]["truncate"]))
        got = len(pairs[rd["group"]]) * sum(s["length"] for s in rd["segments"])
        if got != want * d["block_len"]:
            return (f"layer {rd['layer']}'s {rd['half']} would receive {got} bytes of the {want * d['block_len']} its "
                    f"{want} {rd['group']} blocks hold")
    return None


def received_k_blocks(plan: dict, pairs: dict[str, np.ndarray]) -> list[tuple[int, np.ndarray]]:
    """(decode entry, decode block ids) of the K blocks a request's reads land, each entry once:
    what the packed-K conversion relays."""
    entries: dict[int, set] = {}
    regions = plan["decode"]["regions"]
    for rd in plan["ranks"][0]["reads"]:
        if rd["half"] == "K" and len(pairs[rd["group"]]):
            entries.setdefault(regions[rd["decode_region"]]["entry"], set()).update(pairs[rd["group"]][:, 0].tolist())
    return [(e, np.array(sorted(ids), dtype=np.int64)) for e, ids in sorted(entries.items())]


def covering_lengths(block: int, window: int) -> list[int]:
    """Prompt lengths a DI verify runs by default: longer than the window, one with N % block == 0
    and one at the SWA N-1 boundary N % block == block - 1."""
    n = (window // block + 1) * block
    return [n, n + block - 1]
