"""``gkbuild verify --report DIR``: the verify report as ``report.json`` (the same object ``--json``
prints) and a self-contained ``report.html`` whose plots (matplotlib) are embedded PNGs.

Plots: max |logit error| by sequence x position; hidden-state relative error by layer (free-running,
on the reference's input, the worst expert, and the limits); top-k agreement by position; the
reference's router margins and the forced routings by layer; routing coverage by layer. Text: the
tolerance tier and the verdict, what departs first, the tail, and each sequence's continuation by
the reference and by the build.
"""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path

from .errors import GkError

FILES = ("report.json", "report.html")


def write(rep: dict, out: Path, title: str) -> list[Path]:
    """Write both files into ``out`` (created if needed; each written whole, then renamed)."""
    from .pipeline.state import write_bytes_atomic

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise GkError(f"--report {out}: not a folder")
    plots = figures(rep)
    doc = page(rep, title, plots)
    write_bytes_atomic(out / "report.json", (json.dumps(rep, indent=2, allow_nan=False) + "\n").encode())
    write_bytes_atomic(out / "report.html", doc.encode())
    return [out / f for f in FILES]


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def figures(rep: dict) -> list[tuple[str, str]]:
    """[(caption, base64 PNG)] for the report's plots."""
    return [(caption, _png(fig)) for caption, fig in plots(rep)]


def _counted(ax) -> None:
    """Layers and positions are counts: whole-number ticks only (matplotlib would put 0.25, 0.5...
    on an axis of a few layers)."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _legend(ax, *more) -> None:
    """One legend for every series of ``ax`` and its twins ``more``, right of the plot (and of a
    twin's axis), outside the data it explains: the figure's constrained layout makes room."""
    handles, labels = [], []
    for a in (ax, *more):
        h, lab = a.get_legend_handles_labels()
        handles += h
        labels += lab
    ax.figure.legend(handles, labels, fontsize=7, loc="outside right upper")


def plots(rep: dict) -> list[tuple[str, object]]:
    """[(caption, matplotlib figure)] for the report's plots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = []
    nan = float("nan")
    err = [[nan if v is None else v for v in row] for row in rep["position_errors"]]
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.35 * len(err)))
    im = ax.imshow(err, aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_xlabel("position")
    ax.set_ylabel("sequence")
    ax.set_yticks(range(len(err)))
    _counted(ax)
    fig.colorbar(im, ax=ax, label="max |logit error|")
    out.append(("max |logit error| by sequence and position", fig))

    L = len(rep["layer_errors"])
    layers = list(range(L))
    floor = 1e-9

    def pos(v):  # a log axis shows no zero or null
        return floor if v is None else max(v, floor)

    fig, ax = plt.subplots(figsize=(9, 3.5), layout="constrained")
    ax.semilogy(layers, [pos(e) for e in rep["layer_errors"]], "o-", label="free-running (own input)")
    ax.semilogy(layers, [pos(e) for e in rep["layer_local_errors"]], "s-", label="on the reference's input")
    ax.semilogy(layers, [pos(e) for e in rep["layer_local_median"]], "s:", label="on the reference's input, median")
    ax.semilogy(layers, [pos(e) for e in rep["experts"]["worst_by_layer"]], "^-", label="worst expert (probe rows)")
    ax.axhline(rep["blame_threshold"], color="red", ls="--", lw=1, label="a layer departs above (worst)")
    ax.axhline(rep["blame_threshold_median"], color="red", ls=":", lw=1, label="a layer departs above (median)")
    ax.axhline(rep["experts"]["tolerance"], color="purple", ls=":", lw=1, label="an expert departs above")
    if rep["first_bad_layer"] is not None:
        ax.axvline(rep["first_bad_layer"], color="red", lw=2, alpha=0.3, label="first departing layer")
    ax.set_xlabel("layer")
    ax.set_ylabel("relative error")
    _counted(ax)
    _legend(ax)
    out.append(("hidden-state relative error by layer", fig))

    steps = rep["steps"]
    where = [s["step"] for s in steps]
    fig, ax = plt.subplots(figsize=(9, 3), layout="constrained")
    exact = [s["top1_exact"] for s in steps]
    near = [s["top1_near"] for s in steps]
    wrong = [s["top1_wrong"] for s in steps]
    ax.bar(where, exact, label="top-1 exact", color="tab:green")
    ax.bar(where, near, bottom=exact, label="top-1 near tie", color="tab:orange")
    ax.bar(where, wrong, bottom=[a + b for a, b in zip(exact, near)], label="top-1 wrong", color="tab:red")
    ax.set_xlabel("position")
    ax.set_ylabel("sequences")
    ax2 = ax.twinx()
    ax2.plot(where, [s["top5_overlap"] for s in steps], "k.-", label="top-5 overlap")
    ax2.set_ylim(0, 1.05)
    ax2.set_ylabel("top-5 overlap")
    _counted(ax)
    _legend(ax, ax2)
    out.append(("top-k agreement by position", fig))

    fig, ax = plt.subplots(figsize=(9, 3), layout="constrained")
    margin = rep["router_margin"]
    ax.semilogy(layers, [pos(m["min"]) for m in margin], "o-", label="reference's smallest margin")
    ax.semilogy(layers, [pos(m["median"]) for m in margin], "s-", label="median margin")
    ax.axhline(rep["tie"], color="red", ls="--", lw=1, label="a tie at or below")
    ax.set_xlabel("layer")
    ax.set_ylabel("router margin (k-th minus (k+1)-th logit)")
    ax2 = ax.twinx()
    ax2.bar(layers, rep["layer_forced"], alpha=0.3, color="tab:red", label="forced routings")
    ax2.set_ylabel("forced (distinct token-layers)")
    _counted(ax)
    _legend(ax, ax2)
    out.append(("router margin and forced routings by layer", fig))

    fig, ax = plt.subplots(figsize=(9, 2.5), layout="constrained")
    ax.bar(layers, rep["experts"]["routed_by_layer"], label="experts the reference routed to")
    ax.axhline(rep["experts"]["checked"] / max(L, 1), color="k", ls="--", lw=1, label="experts checked on probe rows")
    ax.set_xlabel("layer")
    ax.set_ylabel("experts")
    _counted(ax)
    _legend(ax)
    out.append(("routing coverage by layer", fig))
    return out


def page(rep: dict, title: str, plots: list[tuple[str, str]]) -> str:
    """The report as one HTML document (no external resources)."""
    e = html.escape
    verdict = "PASS" if rep["ok"] else "FAIL"
    culprit = rep["culprit"] or ("none" if rep["ok"] else "no single part (see the logit table)")
    facts = [("verdict", verdict), ("tolerance tier", rep["tolerances"]), ("golden KV", rep["golden_kv"]),
             ("build KV", rep["build_kv"]), ("first departure", culprit),
             ("first out-of-tolerance position", "none" if rep["first_failure"] is None
              else f"sequence {rep['first_failure'][0]}, position {rep['first_failure'][1]}"),
             ("max |logit error|", _g(rep["max_abs_err"])), ("min cosine", _g(rep["min_cosine"])),
             ("routing forced at ties", f"{rep['routing_forced']} of {rep['routing_total']} token-layers"),
             ("experts checked", f"{rep['experts']['checked']}, {len(rep['experts']['failing'])} departing"),
             ("tail: final norm / lm_head error", f"{_g(rep['tail']['norm_error'])} / {_g(rep['tail']['lm_head_error'])}"
              f" (limit {rep['tail']['tolerance']:.0e})")]
    rows = "".join(f"<tr><th>{e(k)}</th><td>{e(str(v))}</td></tr>" for k, v in facts)
    texts = "".join(f"<tr><td>{i}</td><td>{e(t['prompt'])}</td><td>{e(t['reference'])}</td><td>{e(t['build'])}</td>"
                    f"<td>{t['agree']}/{t['length']}</td></tr>" for i, t in enumerate(rep["texts"]))
    figs = "".join(f"<figure><img alt=\"{e(c)}\" src=\"data:image/png;base64,{b}\"><figcaption>{e(c)}</figcaption>"
                   f"</figure>" for c, b in plots)
    color = "#1a7f37" if rep["ok"] else "#cf222e"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{e(title)}</title>
<style>body{{font-family:sans-serif;max-width:1000px;margin:2em auto;color:#1f2328}}
h1 span{{color:{color}}} table{{border-collapse:collapse;margin:1em 0}} th,td{{border:1px solid #d0d7de;
padding:4px 8px;text-align:left;vertical-align:top}} figure{{margin:1.5em 0}} img{{max-width:100%}}
figcaption{{font-size:90%;color:#57606a}}</style></head>
<body><h1>{e(title)}: <span>{verdict}</span></h1>
<table>{rows}</table>
{figs}
<h2>Continuations (teacher-forced: the build's next-token choice at each position)</h2>
<table><tr><th>seq</th><th>prompt</th><th>reference</th><th>build</th><th>agree</th></tr>{texts}</table>
</body></html>
"""


def _g(x) -> str:
    return "n/a" if x is None else f"{x:.3g}"
