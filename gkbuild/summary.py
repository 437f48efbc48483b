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


LAYOUT_TEXT = {
    "mxfp4": "mxfp4 (the hub's: experts as MXFP4 blocks and scales)",
    "bf16": "bf16 (dense: transformers' gate_up_proj / down_proj; gkbuild quantize makes it MXFP4)",
    "fp32": "fp32 (dense: transformers' gate_up_proj / down_proj; gkbuild quantize makes it MXFP4)",
}


def checkpoint_summary(ck: Checkpoint) -> dict:
    c = ck.config
    name = match_preset(c)
    total = sum(h.size for h in ck.headers.values())
    return {
        "kind": "checkpoint",
        "path": str(ck.root),
        "preset": name,
        "layout": ck.layout,  # how the experts are held: names.LAYOUTS
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
        ("layout", LAYOUT_TEXT.get(s["layout"], s["layout"])),
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


def device_table(groups: list[dict], budget: dict, host_files: list[dict]) -> list:
    """Per-rank device memory (ranks with equal figures on one row): the weights each rank's programs
    read by file role, the KV buffers, the reserve, the total; then the host-only files apart."""
    roles = [r for r in ("shared", "attn", "expert", "tail", "embed") if any(r in g["weights_by_role"] for g in groups)]
    hbm = budget.get("hbm_per_rank_bytes")
    t = Table(title="device memory per rank" + (f" (of {human_bytes(hbm)} HBM)" if hbm else ""), title_justify="left")
    for c in ["ranks", *roles, "weights", "KV", "reserve", "total"] + (["free"] if hbm else []):
        t.add_column(c, justify="left" if c == "ranks" else "right")
    for g in groups:
        t.add_row(g["ranks"], *(human_bytes(g["weights_by_role"].get(r, 0)) for r in roles),
                  human_bytes(g["weights_bytes"]), human_bytes(g["kv_bytes"]), human_bytes(g["reserve_bytes"]),
                  human_bytes(g["total_bytes"]), *([human_bytes(hbm - g["total_bytes"])] if hbm else []))
    out = [t]
    for h in host_files:
        size = human_bytes(h["bytes"]) if h.get("bytes") is not None else "?"
        out.append(f"host-only (not in device memory): {h['file']} {size}, {', '.join(h['tensors'])}, "
                   f"used by the {h['program']} program's runtime")
    return out


def plan_tables(plan) -> list:
    """The plan as a user reads it: each file kind, what a rank loads, the KV budget."""
    j = plan.to_json()
    t = plan.recipe.topology
    out = []
    head = Table(title=f"plan {plan.recipe.name}: {plan.recipe.target}, {plan.world} ranks "
                       f"(TP{t.tp} x DP{t.dp} x EP{t.ep}, LNC {t.lnc}, VTP {t.vtp})", title_justify="left")
    for c in ("file kind", "files", "ranks a file", "tensor", "shape", "dtype", "bytes"):
        head.add_column(c, justify="right" if c in ("files", "ranks a file", "bytes") else "left")
    for role, e in j["files"].items():
        first = True
        for name, ts in e["tensors"].items():
            nbytes = next(s.nbytes for f in plan.files if f.role == role for s in f.tensors if s.name == name)
            head.add_row(role if first else "", str(e["files"]) if first else "",
                         str(e["ranks_per_file"]) if first else "", name, str(ts["shape"]), ts["dtype"],
                         human_bytes(nbytes))
            first = False
        head.add_section()
    out.append(head)
    kv = j["kv"]
    facts = Table(show_header=False, title="per rank", title_justify="left")
    facts.add_column(style="bold")
    facts.add_column()
    dma = kv["dma"]
    budget = kv["budget"]
    rows = [
        ("device weights per rank", human_bytes(j["bytes_per_rank"])),
        ("host-only bytes", human_bytes(j["host_bytes"])),
        ("weights on disk (deduplicated)", human_bytes(j["disk_bytes"])),
        ("embedding / RoPE", f"{j['embedding']} / {j['rope']}"),
        ("KV cache", f"{kv['form']}: {kv['allocations']} x {kv['allocation_shape']} {kv['dtype']}"
                     + (f", K entry packed {kv['k_entry_shape']}" if kv["packed"] else "")),
        ("KV bytes per rank", f"{kv['bytes_per_rank']:,} ({human_bytes(kv['bytes_per_rank'])})"),
        ("KV budget", budget_line(budget)),
        ("DMA offset check", f"{'ok' if dma['fits'] else 'OVER'}: one DMA base spans "
                             f"{human_bytes(dma['span_bytes'])} of 4 GiB; at most {dma['max_num_blocks']:,} blocks "
                             f"in this form (stacked {dma['max_num_blocks_stacked']:,}, paired "
                             f"{dma['max_num_blocks_paired']:,})"),
        ("tail", f"vocab {j['tail']['vocab_per_rank']} a rank, hops {j['tail']['hops']}, k {j['tail']['k']}"),
        ("softmax_scale", f"{j['scalars']['softmax_scale']:.6g}"),
    ]
    for k, v in rows:
        facts.add_row(k, v)
    out.append(facts)
    out += device_table(j["device_memory"], budget, j["host_files"])
    return out


def budget_line(b: dict) -> str:
    if b["mode"] == "given":
        return f"{b['num_blocks']:,} blocks (given); device reserve {human_bytes(b['reserve_bytes'])}"
    capped = f", capped by the DMA limit from {b['fits_blocks']:,}" if b["capped_by_dma"] else ""
    return (f"{b['num_blocks']:,} blocks (hbm: {human_bytes(b['usable_bytes'])} usable of "
            f"{human_bytes(b['hbm_per_rank_bytes'])} at memory_utilization {b['memory_utilization']} and a "
            f"{human_bytes(b['reserve_bytes'])} reserve - {human_bytes(b['device_weight_bytes'])} device weights"
            f"{capped}; host-only bytes not charged)")


def build_tables(s: dict) -> list:
    head = Table(title=f"build {s['path']}", show_header=False, title_justify="left")
    head.add_column(style="bold")
    head.add_column()
    t = s["topology"]
    kv = s["kv"]
    rows = [
        ("name / build id", f"{s['name']} / {s['build_id'][:16]}"),
        ("target", s["target"]),
        ("ranks", f"{s['ranks']} (TP{t['tp']} x DP{t['dp']} x EP{t['ep']}, LNC {t['lnc']}, VTP {t['vtp']} "
                  f"hops {t['hops']})"),
        ("source", s["source"].get("uri", "")),
        ("files", f"{s['files']} ({human_bytes(s['bytes'])} on disk)"),
        ("device weights per rank", human_bytes(s["bytes_per_rank"])),
        ("embedding / RoPE", f"{s['embedding']} / {s['rope']}"),
        ("KV", f"{kv['form']} {kv['allocation_shape']} {kv['dtype']}{' packed K' if kv['packed'] else ''}, "
               f"{kv['num_blocks']} blocks, {human_bytes(kv['bytes_per_rank'])} a rank"),
        ("KV budget", budget_line(kv["budget"])),
        ("tail", f"vocab {s['tail']['vocab_per_rank']} a rank, k {s['tail']['k']}"),
        ("compile", f"{s['compile']['status']} ({s['compile']['artifacts']} artifacts)"),
        *([("code target", s["compile"]["code_target"])] if s["compile"].get("code_target") else []),
    ]
    for k, v in rows:
        head.add_row(k, v)
    roles = Table(title="files by role", title_justify="left")
    for c in ("role", "files", "bytes"):
        roles.add_column(c, justify="left" if c == "role" else "right")
    for role, e in s["by_role"].items():
        roles.add_row(role, str(e["files"]), human_bytes(e["bytes"]))
    progs = Table(title="programs", title_justify="left")
    for c in ("program", "batch", "LNC", "in/out", "kernel", "switches", "doctor answers relied on", "NEFF"):
        progs.add_column(c)
    for p in s["programs"]:
        asked = ", ".join(f"{n.removeprefix('VLLM_NEURON_MEGA_')}={v}" for n, v in p["switches_from_recipe"].items())
        kernel = f"{p['library']} {p['entry'].rpartition(':')[2]}" if p["entry"] else "the torch twins"
        sw = (f"{len(p['switches'])} set explicitly" if p["switches"] else "set at trace") + \
            (f"; recipe: {asked}" if asked else "; reference path")
        progs.add_row(p["name"], str(p["batch_size"] or "any"), str(p["lnc"]), f"{p['inputs']}/{p['outputs']}",
                      kernel, sw if p["entry"] else "-",
                      ", ".join(f"{k}: {v}" for k, v in p["doctor"].items()) or "-", p["neff_version"] or ("-" if p["format"] != "neff" else p["status"]))
    stages = Table(title="stages", title_justify="left")
    stages.add_column("stage")
    stages.add_column("cache")
    for st in s["stages"]:
        stages.add_row(st["name"], "[green]up to date[/]" if st["cached"] else "[yellow]stale or unknown[/]")
    return [head, roles, *device_table(s["device_memory"], kv["budget"], s["host_files"]), progs, stages]
