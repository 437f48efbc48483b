"""``layout/kv.json`` and ``layout/tail.json`` held to what their build's manifest says, when a build
is opened: a runtime, ``di plan`` and a DI peer read them, and each is data from a disk.

The KV layout's scalars (types, ranges, the KV format) make a ``KvLayout``; every other field the
file holds (entries, per-layer entries, DI regions with their offsets, block pool, ...) must be
exactly what those scalars give, its scalars must agree with the manifest's model, topology and
recipe, and each rank's kv heads with its TP coordinate. The tail layout must be exactly what the
manifest's topology and recipe give. Anything else is one line naming the file and the field.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import GkError, shown
from .kv import FORMS, KvLayout
from .tail import owned_rows

KV_DTYPES = {"bf16": 2, "fp8_e4m3": 1, "fp8_e4m3fn": 1}
_INTS = ("num_layers", "num_blocks", "kv_heads", "block_size", "head_dim", "itemsize")


def _scalars(doc: dict, entry: dict, where: Path) -> KvLayout:
    """A KvLayout from ``kv.json``'s scalars only if every value is in range and agrees with the
    manifest's layout entry (nothing is allocated from an unchecked number)."""
    for k in _INTS:
        v = doc.get(k)
        if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= 1 << 31:
            raise GkError(f"{where}: {k} is {shown(v)}; expected an integer in 1..{1 << 31}")
    if doc.get("dtype") not in KV_DTYPES or KV_DTYPES[doc["dtype"]] != doc["itemsize"] \
            or not isinstance(doc.get("packed"), bool):
        raise GkError(f"{where}: dtype {shown(doc.get('dtype'))} / itemsize / packed are not a KV format")
    if doc.get("form") not in FORMS:
        raise GkError(f"{where}: form {shown(doc.get('form'))} is not one of {', '.join(FORMS)}")
    for k in ("form", "num_blocks", "block_size", "dtype", "packed"):
        if doc[k] != entry.get(k):
            raise GkError(f"{where}: {k} is {shown(doc[k])}, the manifest says {shown(entry.get(k))}")
    return KvLayout(**{k: doc[k] for k in ("form", *_INTS[:5], "dtype", "itemsize", "packed")})


def _differs(where: Path, got: dict, want: dict, of: str) -> None:
    for k, v in want.items():
        if got.get(k) != v:
            raise GkError(f"{where}: {k} is {shown(got.get(k))}; {of} give {shown(v)}")


def _no_extra(where: Path, doc: dict, known) -> None:
    extra = sorted(set(doc) - set(known))
    if extra:
        raise GkError(f"{where}: unexpected field {shown(extra[0])}")


def kv(doc: dict, m: dict, root: Path) -> KvLayout:
    """The KV layout of the build at ``root`` from its ``kv.json`` (``doc``) and manifest ``m``,
    checked whole."""
    from ..model import GptOssConfig
    from ..pipeline.manifest import NAME
    from .dims import Dims

    where = root / m["layout"]["kv"]["file"]
    lay = _scalars(doc, m["layout"]["kv"], where)
    model, t, kvc = m["model"], m["topology"], m["recipe"]["resolved"].get("kv_cache", {})
    cfg = GptOssConfig.from_hf(model, f"{root / NAME}: model")
    dims = Dims.of(cfg, tp=t["tp"], ep=t["ep"], vtp=t["vtp"])
    # the sizes first, against the manifest's model: every per-layer list below is sized by them
    _differs(where, doc, {"num_layers": cfg.L, "head_dim": cfg.d, "kv_heads": dims.kv_l,
                          "budget": m["layout"]["kv"].get("budget"), "block_size": kvc.get("block_size"),
                          "form": kvc.get("form")}, "the manifest's model, topology and recipe")
    _differs(where, doc, {"kv_heads_of_rank": {str(r["rank"]): dims.kv_heads_of(r["tp"]) for r in m["ranks"]}},
             "the manifest's model, topology and recipe")
    derived = json.loads(json.dumps(lay.describe()))
    _differs(where, doc, derived, "its form, num_layers, num_blocks, kv_heads, block_size, head_dim and dtype")
    _differs(root / NAME, m["layout"]["kv"],
             {k: derived[k] for k in ("entries", "allocation_shape", "allocations", "bytes_per_rank")},
             f"the scalars of {where}")
    _no_extra(where, doc, [*derived, "kv_heads_of_rank", "budget"])
    return lay


def tail(doc: dict, m: dict, root: Path) -> None:
    """Refuse the ``tail.json`` (``doc``) of the build at ``root`` that is not exactly what its
    manifest's topology and recipe give."""
    from ..pipeline.manifest import NAME
    from ..recipe import MAX_BATCH, MAX_BATCH_SIZES

    where = root / m["layout"]["tail"]["file"]
    t, r = m["topology"], m["recipe"]["resolved"]
    bs = r.get("decode", {}).get("batch_sizes")  # rows are derived for each: bounded first, as a recipe's are
    if not isinstance(bs, list) or not 0 < len(bs) <= MAX_BATCH_SIZES or any(
            isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= MAX_BATCH for b in bs):
        raise GkError(f"{root / NAME}: recipe decode.batch_sizes {shown(bs)}: expected 1..{MAX_BATCH_SIZES} "
                      f"integers in 1..{MAX_BATCH}")
    groups = t.get("a2a_batch_groups", 1)
    want = {"vtp": t["vtp"], "vocab_per_rank": m["layout"]["tail"]["vocab_per_rank"], "hops": t["hops"],
            "k": m["layout"]["tail"]["k"], "emit_logits": r.get("tail", {}).get("emit_logits"),
            "a2a_batch_groups": groups, "hop_meshes": t["meshes"]["tail_hop_meshes"]}
    _differs(where, doc, want, "the manifest's topology and recipe")
    try:
        rows = {str(b): {str(c["rank"]): owned_rows(c["vtp"], t["vtp"], b, t["hops"], groups) for c in m["ranks"]}
                for b in r["decode"]["batch_sizes"]}
    except (ValueError, TypeError, KeyError) as e:
        raise GkError(f"{where}: the manifest's topology gives no tail exchange ({e})") from None
    _differs(where, doc, {"owned_rows": rows}, "the manifest's topology and batch sizes")
    _no_extra(where, doc, [*want, "owned_rows"])
