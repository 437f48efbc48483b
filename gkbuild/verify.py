"""``gkbuild verify``: run a build's decode steps through the twins and compare with the reference.

Comparison follows NxD Inference's logit validation:
- a tolerance map: for the reference's top-5 / top-50 / top-1000 / all logits of each position,
  |ours - ref| <= atol + rtol * |ref|;
- teacher forcing: every step is fed the reference's token, so one divergence does not cascade;
- an allowed divergence: our argmax may differ where the reference scores it within
  ``divergence_tol`` of its own max (a near tie).

Defaults are tight for bf16 KV and looser for FP8 KV (e4m3 keeps 3 mantissa bits: each stored K/V
element moves by up to ~6%). On failure the report names the first (sequence, step) that broke
and the first layer whose hidden state departs from the reference there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pathlib import Path

import torch

from .errors import GkError

# {top-k or None (all): (atol, rtol)}
TOLERANCES = {
    "bf16": {5: (0.02, 0.01), 50: (0.03, 0.02), 1000: (0.05, 0.03), None: (0.08, 0.05)},
    "fp8": {5: (0.25, 0.05), 50: (0.3, 0.08), 1000: (0.4, 0.1), None: (0.6, 0.15)},
}
DIVERGENCE_TOL = {"bf16": 0.05, "fp8": 0.3}
ROUTING_TOL = {"bf16": 0.02, "fp8": 0.2}  # router logits within this of the k-th choice: a near tie
# relative error of a layer's hidden state that counts as departed (passing tiny builds stay under
# ~0.003 with bf16 KV and ~0.03 with FP8 KV)
LAYER_TOL = {"bf16": 0.02, "fp8": 0.1}


@dataclass
class StepReport:
    step: int  # position in the sequence (0 = first prompt token)
    top1_exact: int
    top1_near: int  # argmax differs within the divergence tolerance
    top1_wrong: int
    max_err: dict  # tier -> max |ours - ref| over the tier
    min_cosine: float
    ok: bool


@dataclass
class Report:
    steps: list[StepReport]
    ok: bool
    kv: str
    first_failure: tuple[int, int] | None = None  # (sequence, step)
    first_bad_layer: int | None = None
    layer_errors: list[float] = field(default_factory=list)  # at the position the departure was found
    max_abs_err: float = 0.0
    min_cosine: float = 1.0
    routing_forced: int = 0  # token-layers whose near-tie routing took the reference's experts
    routing_total: int = 0

    def to_dict(self) -> dict:
        return {"ok": self.ok, "kv": self.kv, "max_abs_err": self.max_abs_err, "min_cosine": self.min_cosine,
                "routing_forced": self.routing_forced, "routing_total": self.routing_total,
                "first_failure": self.first_failure, "first_bad_layer": self.first_bad_layer,
                "layer_errors": self.layer_errors,
                "steps": [{"step": s.step, "top1_exact": s.top1_exact, "top1_near": s.top1_near,
                           "top1_wrong": s.top1_wrong, "max_err": {str(k): v for k, v in s.max_err.items()},
                           "min_cosine": s.min_cosine, "ok": s.ok} for s in self.steps]}


def compare_position(ours: torch.Tensor, ref: torch.Tensor, tol: dict, div_tol: float) -> tuple[bool, str, dict]:
    """One sequence position: (ok, top-1 verdict exact/near/wrong, max error per tier)."""
    order = torch.argsort(ref, descending=True, stable=True)
    errs, ok = {}, True
    for k, (atol, rtol) in tol.items():
        idx = order if k is None else order[:k]
        diff = (ours[idx] - ref[idx]).abs()
        errs[k] = float(diff.max())
        ok &= bool((diff <= atol + rtol * ref[idx].abs()).all())
    a, b = int(ours.argmax()), int(ref.argmax())
    if a == b:
        verdict = "exact"
    elif float(ref[b] - ref[a]) <= div_tol:
        verdict = "near"
    else:
        verdict, ok = "wrong", False
    return ok, verdict, errs


def compare(logits: torch.Tensor, ref: torch.Tensor, kv: str, steps_from: int = 0) -> Report:
    """logits, ref: [P, T, V]; positions before ``steps_from`` are not judged."""
    tol, div = TOLERANCES[kv], DIVERGENCE_TOL[kv]
    P, T, _ = ref.shape
    reports, first = [], None
    for t in range(steps_from, T):
        counts = {"exact": 0, "near": 0, "wrong": 0}
        worst = {k: 0.0 for k in tol}
        step_ok = True
        for p in range(P):
            ok, verdict, errs = compare_position(logits[p, t], ref[p, t], tol, div)
            counts[verdict] += 1
            worst = {k: max(worst[k], errs[k]) for k in tol}
            if not ok:
                step_ok = False
                first = first or (p, t)
        cos = torch.nn.functional.cosine_similarity(logits[:, t], ref[:, t], dim=-1).min()
        reports.append(StepReport(t, counts["exact"], counts["near"], counts["wrong"], worst, float(cos), step_ok))
    rep = Report(reports, first is None, kv, first)
    rep.max_abs_err = max(s.max_err[None] for s in reports)
    rep.min_cosine = min(s.min_cosine for s in reports)
    return rep


def attribute(ours: list[list[list[torch.Tensor]]], ref: torch.Tensor, until: int, kv: str):
    """The first layer to depart from the reference: at the earliest position (up to ``until``)
    where any sequence's hidden state departs, the lowest such layer. ours[p][t][l] is [H];
    ref is [P, L, T, H]. Returns (layer or None, that position's worst error per layer)."""
    for t in range(until + 1):
        errs = [max(float((ours[p][t][l] - ref[p, l, t]).norm() / ref[p, l, t].norm().clamp_min(1e-12))
                    for p in range(len(ours))) for l in range(ref.shape[1])]
        bad = next((i for i, e in enumerate(errs) if e > LAYER_TOL[kv]), None)
        if bad is not None:
            return bad, errs
    return None, errs


def run(build_dir, golden=None, steps: int = 16, prompts: int | None = None, prompt_len: int = 4,
        engine: str = "twin") -> Report:
    """Verify a build against a golden (computed from the build's source when none is given),
    running it through the torch twins, (``engine="compiled"``) its compiled .pt2 programs, or
    (``engine="neuron"``, on a Trainium host) its NEFFs on the NeuronCores."""
    from .golden import Golden, checkpoint_hash, default_prompts, for_checkpoint
    from .kernels.decode import RoutingGuide
    from .kernels.driver import Session
    from .runtime import Build

    build = Build.open(build_dir)
    m = build.manifest
    batch = max(m["recipe"]["resolved"]["decode"]["batch_sizes"])
    if engine == "neuron":
        from .compile import neuron_run

        neuron_run.check(m)  # before a golden is computed: one line where no Trainium is
    if golden is None:
        from .checkpoint.source import materialize, parse

        src = m["source"]
        # A folder source is recorded as the recipe wrote it: relative paths resolve from here.
        spec = parse(src["uri"], base=Path.cwd())
        n = prompts or min(4, batch)
        g = for_checkpoint(materialize(spec), default_prompts(m["model"]["vocab_size"], n, prompt_len), steps)
    else:
        g = golden if isinstance(golden, Golden) else Golden.load(golden)
        want = checkpoint_hash(m["source"]["files"])
        if g.meta.get("checkpoint_sha256") not in (None, want):
            raise GkError(f"{golden}: the golden was made from another checkpoint than this build's source")
    P, T = g.token_ids.shape
    if T > 0 and g.logits.shape[-1] != m["model"]["vocab_size"]:
        raise GkError("the golden's vocabulary does not match the build's model")
    rows = torch.arange(batch) % P  # every row of the batch runs one of the golden's sequences
    kv = "fp8" if m["layout"]["kv"]["dtype"].startswith("fp8") else "bf16"
    if engine == "neuron":
        return _on_neuron(build, g, batch, rows, kv)
    session = Session(build, batch, max_len=T, engine=engine)
    ours = torch.empty(P, T, g.logits.shape[-1])
    hid = [[None] * T for _ in range(P)]
    forced = 0
    for t in range(T):
        guide = RoutingGuide(g.routing[rows, :, t].transpose(0, 1), ROUTING_TOL[kv])
        res = session.step(g.token_ids[rows, t], collect_hiddens=True, guide=guide)
        forced += guide.forced
        for b in range(batch):  # every replica of a sequence must agree; keep the worst
            p = int(rows[b])
            if hid[p][t] is None or _worse(res.logits[b], ours[p, t], g.logits[p, t]):
                ours[p, t] = res.logits[b]
                hid[p][t] = [h[b] for h in res.hiddens]
    rep = compare(ours, g.logits, kv)
    rep.routing_forced, rep.routing_total = forced, T * batch * g.routing.shape[1]
    if rep.first_failure:
        rep.first_bad_layer, rep.layer_errors = attribute(hid, g.hidden, rep.first_failure[1], kv)
    return rep


def _on_neuron(build, g, batch: int, rows, kv: str) -> Report:
    """The Neuron programs on this host's NeuronCores (``compile.neuron_run``): logits only, so the
    report has no per-layer attribution; every replica of a sequence must agree (keep the worst)."""
    import tempfile
    from pathlib import Path

    from .compile import neuron_run

    with tempfile.TemporaryDirectory(prefix="gkbuild-neuron-") as tmp:
        golden_path = Path(tmp) / "golden.safetensors"
        g.save(golden_path)
        logits = neuron_run.run(build, golden_path, batch, Path(tmp) / "out")  # [batch, T, V]
    P, T = g.token_ids.shape
    ours = torch.empty(P, T, g.logits.shape[-1])
    for p in range(P):
        mine = logits[rows == p]
        worst = (mine - g.logits[p]).abs().amax(dim=(1, 2)).argmax()
        ours[p] = mine[worst]
    return compare(ours, g.logits, kv)


def _worse(candidate: torch.Tensor, current: torch.Tensor, ref: torch.Tensor) -> bool:
    return float((candidate - ref).abs().max()) > float((current - ref).abs().max())
