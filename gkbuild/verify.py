"""``gkbuild verify``: run a build's decode steps through the twins and compare with the reference.

Comparison follows NxD Inference's logit validation:
- a tolerance map: for the reference's top-5 / top-50 / top-1000 / all logits of each position,
  |ours - ref| <= atol + rtol * |ref|;
- teacher forcing: every step is fed the reference's token, so one divergence does not cascade;
- an allowed divergence: our argmax may differ where the reference scores it within
  ``divergence_tol`` of its own max (a near tie).

The reference rounds K/V the way the build does (``gkbuild.reference.KvFormat``), so a golden
whose KV format matches the build's is held to the tight tolerances at any KV dtype. A golden of
another format is refused unless the caller asks for the loose tier (FP8 rounding in one and not
the other moves each stored K/V element by up to ~6%).

Routing is teacher-forced only at true ties: where the REFERENCE's own router margin between
its k-th and (k+1)-th expert is at most ``TIE`` and our set differs, the reference's set is taken
(counted; more than ``MAX_FORCED`` of the token-layers fails the verify). Anywhere else a
different set is kept and recorded as a departure of that layer. On failure the report names the
first layer whose hidden state or routing departs from the reference, at any position: a fault in
layer l leaves every layer below it exact, so the lowest departing layer is the culprit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .errors import GkError
from .progress import steps_bar
from .reference import KvFormat

# {top-k or None (all): (atol, rtol)}
TOLERANCES = {
    "tight": {5: (0.02, 0.01), 50: (0.03, 0.02), 1000: (0.05, 0.03), None: (0.08, 0.05)},
    "loose": {5: (0.25, 0.05), 50: (0.3, 0.08), 1000: (0.4, 0.1), None: (0.6, 0.15)},
}
DIVERGENCE_TOL = {"tight": 0.05, "loose": 0.3}
TIE = 0.01  # the reference's router margin at or below which its choice is a tie
MAX_FORCED = 0.02  # share of token-layers the routing guide may force
# relative error of a layer's hidden state that counts as departed
LAYER_TOL = {"tight": 0.01, "loose": 0.1}


def build_kv(m: dict) -> KvFormat:
    """The KV format a build's kernel stores (dtype and dequant scales), from its manifest."""
    kv = m["layout"]["kv"]
    if kv["dtype"] == "bf16":
        return KvFormat("bf16")
    rk = m["recipe"]["resolved"]["kv_cache"]
    return KvFormat(kv["dtype"], float(rk["k_scale"]), float(rk["v_scale"]))


def tier(golden: KvFormat, build: KvFormat, loose: bool = False) -> str:
    """``tight`` when the golden emulates the build's KV cache (an exact-cache golden stands in for
    bf16: its rounding is below the tight tolerances); otherwise ``loose`` if allowed."""
    same = golden.dtype == build.dtype and all(
        math.isclose(a, b, rel_tol=1e-6) for a, b in ((golden.k_scale, build.k_scale), (golden.v_scale, build.v_scale)))
    if same or (build.dtype == "bf16" and golden.dtype in ("fp32", "bf16")):
        return "tight"
    if loose:
        return "loose"
    raise GkError(f"the golden emulates a {_name(golden)} KV cache and the build stores {_name(build)}; "
                  f"make a matching golden (gkbuild golden --kv {build.dtype}"
                  + (f" --k-scale {build.k_scale} --v-scale {build.v_scale}" if build.fp8 else "")
                  + "), or pass --loose for the loose tolerances")


def _name(f: KvFormat) -> str:
    return f.dtype + (f" (k_scale {f.k_scale}, v_scale {f.v_scale})" if f.fp8 else "")


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
    kv: str  # the tolerance tier: tight | loose
    first_failure: tuple[int, int] | None = None  # (sequence, step)
    first_bad_layer: int | None = None
    layer_errors: list[float] = field(default_factory=list)  # worst relative error per layer, all positions
    layer_routing: list[int] = field(default_factory=list)  # token routings departing per layer
    max_abs_err: float = 0.0
    min_cosine: float = 1.0
    routing_forced: int = 0  # token-layers whose true-tie routing took the reference's experts
    routing_total: int = 0
    golden_kv: str = ""
    build_kv: str = ""
    layer_departs: bool = False  # a layer's hidden state or routing departs (fails at the tight tier)
    unmodeled: list[str] = field(default_factory=list)  # compiled-in kernel switches the twins do not model
    prefilled: int = 0  # positions whose KV came from a DI prefill (the decode ran from there on)

    @property
    def too_many_forced(self) -> bool:
        return self.routing_forced > MAX_FORCED * self.routing_total

    def failure(self) -> str:
        """What failed, in one line: the positions out of tolerance, the first layer whose hidden
        state or routing departs, too many forced routings."""
        where = f"layer {self.first_bad_layer}" if self.first_bad_layer is not None else "the tail (no layer departs)"
        what = []
        if self.first_failure:
            what.append(f"sequence {self.first_failure[0]} position {self.first_failure[1]} is out of tolerance")
        if self.layer_departs:
            i = self.first_bad_layer
            what.append(f"layer {i} departs from the reference (worst hidden-state error {self.layer_errors[i]:.3g}, "
                        f"limit {LAYER_TOL[self.kv]}; {self.layer_routing[i]} routing departures)")
        if self.too_many_forced:
            what.append(f"routing was forced at true ties on {self.routing_forced} of {self.routing_total} "
                        f"token-layers (more than {MAX_FORCED:.0%})")
        di = f" (decoding from position {self.prefilled} on KV pulled over NIXL)" if self.prefilled else ""
        return (f"verify failed{di}: {'; '.join(what)}; the first hidden state or routing to depart from the "
                f"reference is {where}")

    def to_dict(self) -> dict:
        return {"ok": self.ok, "tolerances": self.kv, "golden_kv": self.golden_kv, "build_kv": self.build_kv,
                "max_abs_err": self.max_abs_err, "min_cosine": self.min_cosine,
                "routing_forced": self.routing_forced, "routing_total": self.routing_total,
                "first_failure": self.first_failure, "first_bad_layer": self.first_bad_layer,
                "layer_departs": self.layer_departs,
                "layer_errors": self.layer_errors, "layer_routing_departures": self.layer_routing,
                "unmodeled_switches": self.unmodeled, "prefilled": self.prefilled,
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
    """logits, ref: [P, T, V]; positions before ``steps_from`` are not judged; ``kv``: the tier."""
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


def attribute(errors: torch.Tensor, departed: torch.Tensor, kv: str) -> int | None:
    """The first layer to depart from the reference: the lowest layer whose hidden state (relative
    error, ``errors`` [P, T, L]) or routing (``departed`` [P, T, L] bool) departs at any position."""
    bad = (errors > LAYER_TOL[kv]).any(1).any(0) | departed.any(1).any(0)
    return int(bad.nonzero()[0]) if bad.any() else None


def unmodeled_switches(m: dict) -> list[str]:
    """``NAME=VALUE`` of the kernel switches a build's Neuron programs were compiled with that change
    numerics the twins do not model (what a twin verify cannot vouch for)."""
    from .compile.switches import lossy_on

    return sorted({s for a in m["compile"]["artifacts"] for s in lossy_on(a.get("kernel") or {})})


def check_prefill(engine: str) -> None:
    """A DI verify can run here: the decode on this host (twins or compiled programs) and NIXL
    installed; else one line, before any work."""
    from .di.nixl import api

    if engine == "neuron":
        raise GkError("--prefill nixl decodes through the twins or the compiled programs on this host, not "
                      "--engine neuron")
    api()


def _check_ids(g, model: dict) -> None:
    """Token and expert ids from a golden file index tables: in range, or one line."""
    V, E = model["vocab_size"], model["num_local_experts"]
    k = model.get("num_experts_per_tok", model.get("experts_per_token"))
    for what, ids, top in (("token id", g.token_ids, V), ("routing expert id", g.routing, E)):
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= top):
            raise GkError(f"the golden's {what}s reach {int(ids.max())} (min {int(ids.min())}); the build's model has "
                          f"{top}")
    if g.routing.shape[-1] != k:
        raise GkError(f"the golden routes to {g.routing.shape[-1]} experts a token; the build's model to {k}")


def run(build_dir, golden=None, steps: int = 16, prompts: int | None = None, prompt_len: int = 4,
        engine: str = "twin", loose: bool = False, other_checkpoint: bool = False, quiet: bool = True,
        prefill=None) -> Report:
    """Verify a build against a golden (computed from the build's source, in the build's KV format,
    when none is given), running it through the torch twins, (``engine="compiled"``) its compiled
    .pt2 programs, or (``engine="neuron"``, on a Trainium host) its NEFFs on the NeuronCores; the
    twins' per-layer hidden states are compared as each step produces them. ``other_checkpoint``
    accepts a golden made from another checkpoint than the build's source (to hold a build of an
    edited checkpoint to the original model). ``prefill`` (``di.decode.Prefill``): the prompts'
    first N-1 positions come from a prefill engine over NIXL (``di.decode.pull``); the session
    decodes, and is judged, from position N-1 on."""
    from .golden import Golden, checkpoint_hash, default_prompts, for_checkpoint
    from .kernels.decode import RoutingGuide
    from .kernels.driver import Session
    from .runtime import Build

    build = Build.open(build_dir)
    m = build.manifest
    batch = max(m["recipe"]["resolved"]["decode"]["batch_sizes"])
    if prefill is not None:
        check_prefill(engine)  # before a golden is computed
    if engine == "neuron":
        from .compile import neuron_run

        neuron_run.check(m)  # before a golden is computed: one line where no Trainium is
    fmt = build_kv(m)
    if golden is None:
        from .checkpoint.source import materialize, parse

        src = m["source"]
        # A folder source is recorded as the recipe wrote it: relative paths resolve from here.
        spec = parse(src["uri"], base=Path.cwd())
        n = prompts or min(4, batch)
        g = for_checkpoint(materialize(spec), default_prompts(m["model"]["vocab_size"], n, prompt_len), steps, fmt,
                           quiet=quiet)
    else:
        g = golden if isinstance(golden, Golden) else Golden.load(golden)
        want = checkpoint_hash(m["source"]["files"])
        if not other_checkpoint and g.meta.get("checkpoint_sha256") not in (None, want):
            raise GkError(f"{golden}: the golden was made from another checkpoint than this build's source "
                          f"(--allow-other-checkpoint to compare anyway)")
    kv = tier(g.kv, fmt, loose)
    P, T = g.token_ids.shape
    L = g.hidden.shape[1]
    if g.logits.shape[-1] != m["model"]["vocab_size"] or L != m["model"]["num_hidden_layers"] \
            or g.hidden.shape[-1] != m["model"]["hidden_size"]:
        raise GkError("the golden's model (vocabulary, layers or hidden size) does not match the build's")
    _check_ids(g, m["model"])
    if P > batch:
        raise GkError(f"the golden has {P} sequences; the build decodes batches of at most {batch}")
    rows = torch.arange(batch) % P  # every row of the batch runs one of the golden's sequences
    if engine == "neuron":
        return _on_neuron(build, g, batch, rows, kv)
    session = Session(build, batch, max_len=T, engine=engine, compact_kv=True)
    t0 = 0
    if prefill is not None:
        from .di.decode import pull

        t0 = pull(build, session, g.token_ids[:, :g.prompt_len].tolist(), rows, prefill, quiet)
    ours = torch.empty(P, T, g.logits.shape[-1])
    errors = torch.zeros(P, T, L)
    departed = torch.zeros(P, T, L, dtype=torch.bool)
    forced = 0
    with steps_bar("verify", (T - t0) * L, quiet) as advance:
        for t in range(t0, T):
            guide = RoutingGuide(g.routing[rows, :, t].transpose(0, 1), g.router_gap[rows, :, t].T, TIE)
            res = session.step(g.token_ids[rows, t], collect_hiddens=True, guide=guide,
                               on_layer=lambda i, t=t: advance(1, f"position {t + 1}/{T}, layer {i + 1}/{L}"))
            forced += guide.forced
            ref_h = g.hidden[rows, :, t]  # [B, L, H]
            err = torch.stack([(h - ref_h[:, i]).norm(dim=-1) / ref_h[:, i].norm(dim=-1).clamp_min(1e-12)
                               for i, h in enumerate(res.hiddens)], dim=1)  # [B, L]
            for b in range(batch):  # every replica of a sequence must agree; keep the worst
                p = int(rows[b])
                if b < P or _worse(res.logits[b], ours[p, t], g.logits[p, t]):
                    ours[p, t] = res.logits[b]
                errors[p, t] = torch.maximum(errors[p, t], err[b]) if b >= P else err[b]
                departed[p, t] |= guide.departed[:, b]
    build.close()
    rep = compare(ours, g.logits, kv, steps_from=t0)
    rep.routing_forced, rep.routing_total = forced, (T - t0) * batch * L
    rep.golden_kv, rep.build_kv = _name(g.kv), _name(fmt)
    rep.prefilled = t0
    rep.layer_errors = errors.amax(dim=(0, 1)).tolist()
    rep.layer_routing = departed.sum(dim=(0, 1)).tolist()
    first = attribute(errors, departed, kv)
    # with a golden of the build's KV format a faithful build's hidden states agree to ~1e-4 and its
    # routing differs only at ties: a departing layer fails the verify on its own
    rep.layer_departs = kv == "tight" and first is not None
    rep.ok = rep.ok and not rep.too_many_forced and not rep.layer_departs
    rep.unmodeled = unmodeled_switches(m)
    if not rep.ok:
        rep.first_bad_layer = first
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
