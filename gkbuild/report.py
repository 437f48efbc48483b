"""``gkbuild verify --report DIR``: the verify report as ``report.json`` (the same object ``--json``
prints) and a self-contained ``report.html`` whose plots (matplotlib) are embedded PNGs.

Plots: max |logit error| by sequence x position; hidden-state relative error by layer (free-running,
on the reference's input, the worst expert, and the limits); top-k agreement by position; the
reference's router margins and the forced routings by layer; routing coverage by layer. Text: the
tolerance tier and the verdict, what departs first, the tail, and each sequence's continuation by
the reference and by the build. A dense source's golden adds the section "Quantization (bf16
original vs MXFP4)": the MXFP4 reference's and the build's KL from the original and their top-1
agreement, in numbers and a plot by position.
"""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path

from .errors import GkError

FILES = ("report.json", "report.html")
QUANT_PLOT = "KL from the original and top-1 agreement by position"


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
    if rep.get("quantization"):
        out.append((QUANT_PLOT, _quant_figure(rep["quantization"])))
    return out


def _by_position(rows: list[list], reduce) -> list[float]:
    """A [sequence][position] table (None: not judged) reduced over the sequences at each position."""
    nan = float("nan")
    cols = zip(*[[nan if v is None else float(v) for v in row] for row in rows])
    return [reduce(v) if v else nan for v in ([x for x in c if x == x] for c in cols)]


def _quant_figure(q: dict):
    """KL (nats) of the MXFP4 reference and of the build from the dense original by position (mean
    over sequences, the worst dotted), and the share of sequences whose top-1 agrees with it."""
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(9, 4.5), sharex=True, layout="constrained")
    # the build is usually on top of its reference: thin dashes over a wide line keep both in sight
    series = [(k, label, c, style) for k, label, c, style in (
        ("reference", "MXFP4 reference", "tab:blue", {"lw": 4, "alpha": 0.5}),
        ("build", "build", "tab:red", {"lw": 1.2, "ls": "--"})) if q.get(k)]
    top = 0.0
    for k, label, c, style in series:
        kl = q[k]["kl"]
        where = range(len(kl[0]) if kl else 0)
        mean, worst = _by_position(kl, lambda v: sum(v) / len(v)), _by_position(kl, max)
        top = max([top, *(v for v in worst if v == v)])
        ax.plot(where, mean, marker="o", ms=3, color=c, label=f"{label}: mean KL", **style)
        ax.plot(where, worst, ":", color=c, label=f"{label}: worst KL")
        agree = [[None if m is None else float(a) for a, m in zip(ar, mr)] for ar, mr in zip(q[k]["top1"], kl)]
        ax2.step(where, _by_position(agree, lambda v: sum(v) / len(v)), where="mid", color=c,
                 label=f"{label}: top-1 agreement", **style)
    tol = q.get("tolerance")
    if tol is not None and tol <= 3 * top:  # a far higher gate would flatten the curves: it is in the table
        ax.axhline(tol, color="k", ls="--", lw=1, label="--quant-tolerance (mean)")
    ax.set_ylabel("KL from the original (nats)")
    ax2.set_ylim(-0.05, 1.05)
    ax2.set_ylabel("top-1 agreement\n(share of sequences)")
    ax2.set_xlabel("position")
    _counted(ax2)
    _legend(ax, ax2)
    return fig


def _quant_section(q: dict, figs: str) -> str:
    """The HTML of the quantization section: a table of both measures, then the plot."""
    e = html.escape

    def cells(s: dict | None) -> str:
        if not s or not s["positions"]:
            return "<td>n/a</td>" * 6
        worst = f"sequence {s['worst'][0]}, position {s['worst'][1]}"
        return "".join(f"<td>{e(v)}</td>" for v in (_g(s["mean_kl"]), _g(s["p99_kl"]), _g(s["max_kl"]), worst,
                                                     f"{s['top1_agreement']:.1%}", str(s["positions"])))

    gate = "reported only" if q.get("tolerance") is None else \
        f"mean KL of the build at most {q['tolerance']:g} nats: {'PASS' if q['ok'] else 'FAIL'}"
    layout = q.get("source_layout") or "dense"
    return (f"<h2>Quantization ({e(layout)} original vs MXFP4)</h2>"
            f"<p>Scale rule {e(str(q.get('scale_rule')))}. KL(original || other) in nats per position; the build is "
            f"judged above against the MXFP4 reference it was built from. Gate (--quant-tolerance): {e(gate)}.</p>"
            "<table><tr><th>from the original</th><th>mean KL</th><th>p99 KL</th><th>max KL</th><th>worst at</th>"
            "<th>top-1 agreement</th><th>positions</th></tr>"
            f"<tr><th>MXFP4 reference (the quantization's own effect)</th>{cells(q.get('reference'))}</tr>"
            f"<tr><th>build</th>{cells(q.get('build'))}</tr></table>{figs}")


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
    def fig(c: str, b: str) -> str:
        return f"<figure><img alt=\"{e(c)}\" src=\"data:image/png;base64,{b}\"><figcaption>{e(c)}</figcaption></figure>"

    figs = "".join(fig(c, b) for c, b in plots if c != QUANT_PLOT)
    quant = _quant_section(rep["quantization"], "".join(fig(c, b) for c, b in plots if c == QUANT_PLOT)) \
        if rep.get("quantization") else ""
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
{quant}
<h2>Continuations (teacher-forced: the build's next-token choice at each position)</h2>
<table><tr><th>seq</th><th>prompt</th><th>reference</th><th>build</th><th>agree</th></tr>{texts}</table>
</body></html>
"""


def _g(x) -> str:
    return "n/a" if x is None else f"{x:.3g}"
