"""Human (rich table) and machine (JSON) summaries of a checkpoint."""

from __future__ import annotations

from rich.table import Table

from .checkpoint.reader import Checkpoint
from .model import match_preset


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def checkpoint_summary(ck: Checkpoint) -> dict:
    c = ck.config
    name = match_preset(c)
    total = sum(h.size for h in ck.headers.values())
    return {
        "kind": "checkpoint",
        "path": str(ck.root),
        "preset": name,
        "layers": c.L,
        "experts": c.E,
        "experts_per_token": c.top_k,
        "hidden_size": c.H,
        "intermediate_size": c.I,
        "heads": {"q": c.q_heads, "kv": c.kv_heads, "head_dim": c.d},
        "vocab_size": c.V,
        "sliding_window": c.sliding_window,
        "files": len(ck.headers),
        "tensors": len(ck.where),
        "bytes": total,
        "bytes_by_kind": dict(sorted(ck.bytes_by_kind().items(), key=lambda kv: -kv[1])),
        "extra_tensors": ck.extras,
    }


def checkpoint_table(s: dict) -> list:
    preset = s["preset"] or "no preset matches"
    head = Table(title=f"checkpoint {s['path']}", show_header=False, title_justify="left")
    head.add_column(style="bold")
    head.add_column()
    rows = [
        ("preset", f"{preset}"),
        ("layers", str(s["layers"])),
        ("experts", f"{s['experts']} (top-{s['experts_per_token']})"),
        ("hidden / intermediate", f"{s['hidden_size']} / {s['intermediate_size']}"),
        ("heads q / kv x dim", f"{s['heads']['q']} / {s['heads']['kv']} x {s['heads']['head_dim']}"),
        ("vocab", str(s["vocab_size"])),
        ("sliding window", str(s["sliding_window"])),
        ("files / tensors", f"{s['files']} / {s['tensors']}"),
        ("size", human_bytes(s["bytes"])),
    ]
    for k, v in rows:
        head.add_row(k, v)
    kinds = Table(title="bytes by tensor kind", title_justify="left")
    kinds.add_column("kind")
    kinds.add_column("bytes", justify="right")
    kinds.add_column("share", justify="right")
    for k, v in s["bytes_by_kind"].items():
        kinds.add_row(k, human_bytes(v), f"{100 * v / max(s['bytes'], 1):.1f}%")
    out = [head, kinds]
    if s["extra_tensors"]:
        out.append(f"[yellow]{len(s['extra_tensors'])} tensors not used by gkbuild:[/] "
                   + ", ".join(s["extra_tensors"][:8]))
    return out
