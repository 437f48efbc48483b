"""``gkbuild verify``: run a build through the twins and compare with the reference.

Comparison follows NxD Inference's logit validation:
- a tolerance map: for the reference's top-5 / top-50 / top-1000 / all logits of each position,
  |ours - ref| <= atol + rtol * |ref|;
- teacher forcing: every position is fed the reference's token, so one divergence does not cascade;
- an allowed divergence: our argmax may differ where the reference scores it within
  ``divergence_tol`` of its own max (a near tie).

The reference rounds K/V the way the build does (``gkbuild.reference.KvFormat``), so a golden
whose KV format matches the build's is held to the tight tolerances at any KV dtype. A golden of
another format is refused unless the caller asks for the loose tier (FP8 rounding in one and not
the other moves each stored K/V element by up to ~6%).

Routing is teacher-forced only at true ties: where the REFERENCE's own router margin between
its k-th and (k+1)-th expert is at most ``TIE`` and our set differs, the reference's set is taken
(more than ``MAX_FORCED`` of the distinct (sequence, position, layer) token-layers, and more than
``MIN_FORCED``, fails the verify). Anywhere else a different set is kept and recorded as a departure of that layer.

Beyond the logits, each part of the build is held to the reference on its own:
- every layer runs twice (``kernels.replay``): on its own input (free-running, end to end) and on
  the reference's input to that layer (local). A layer departs when its local hidden-state error
  (the worst, or the median over positions) stands ``BLAME_FACTOR`` times above the faithful noise
  floor (``NOISE_FLOOR``, measured on faithful builds; see bench/RESULTS.md), when its local
  routing departs, or when one of its experts departs;
- every expert of every layer, routed or not, runs on the golden's probe rows through the twin's
  expert path and is compared with the reference's (``EXPERT_TOL``);
- the tail: its final norm on the reference's last hidden state against the reference's norm
  output, and its lm_head on the reference's norm output against the reference's logits
  (``TAIL_TOL``).
The report names the first layer that departs on its own, or the tail's part.

A dense (bf16/fp32) source's golden also holds the dense original's logits (``golden.OPTIONAL``):
the build is still judged tightly against the MXFP4 reference it was built from, and the report's
``quantization`` section states apart the quantization's own effect (the MXFP4 reference against
the original) and the build's distance to the original (``quality``: per-position KL, top-1
agreement), the latter gated by ``quant_tolerance`` (mean KL, nats) when one is given.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from .errors import GkError
from .kernels.tail import leading
from .progress import steps_bar
from .reference import KvFormat, build_kv

# {top-k or None (all): (atol, rtol)}
TOLERANCES = {
    "tight": {5: (0.02, 0.01), 50: (0.03, 0.02), 1000: (0.05, 0.03), None: (0.08, 0.05)},
    "loose": {5: (0.25, 0.05), 50: (0.3, 0.08), 1000: (0.4, 0.1), None: (0.6, 0.15)},
}
DIVERGENCE_TOL = {"tight": 0.05, "loose": 0.3}
TIE = 0.01  # the reference's router margin at or below which its choice is a tie
MAX_FORCED = 0.02  # share of distinct token-layers the routing guide may force
MIN_FORCED = 4  # ties that may be forced whatever the share (a short verify is not failed by a few)
# relative error of a layer's free-running hidden state that fails the tight tier by itself
LAYER_TOL = {"tight": 0.01, "loose": 0.1}
# A faithful build's layers on the reference's input, relative hidden-state error over every
# (sequence, position): up to ~1e-3 where a K/V rounding flips (bf16; FP8 at 120b widths: 1.1e-3
# in 8 layers), ~1e-6 at the median (measured on tiny, tiny-topology and 120b-width builds, bf16
# and FP8 KV: bench/RESULTS.md, "faithful noise floor"). A layer departs BLAME_FACTOR times above
# either; the median is the sharp one (a fault moves most positions, a rounding flip a few).
NOISE_FLOOR = {"max": 1e-3, "median": 1e-5}
BLAME_FACTOR = 10
EXPERT_TOL = 1e-4  # relative error of an expert's output on a probe row (faithful: ~1e-7)
TAIL_TOL = 1e-4  # relative error of the final norm's output and of the logits from it (faithful: ~1e-7)
AHEAD_BYTES = 2 << 30  # experts read ahead of their use on another core, at most (kernels.ahead)


class Clock:
    """Wall and CPU seconds (the whole process: every thread) spent in each named stage."""

    def __init__(self):
        self.spent: dict[str, dict[str, float]] = {}

    @contextlib.contextmanager
    def stage(self, name: str):
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            d = self.spent.setdefault(name, {"wall": 0.0, "cpu": 0.0})
            d["wall"] += time.perf_counter() - wall
            d["cpu"] += time.process_time() - cpu


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
    top5_overlap: float = 1.0  # mean share of the reference's top-5 tokens in ours, over sequences


@dataclass
class Report:
    steps: list[StepReport]
    ok: bool
    kv: str  # the tolerance tier: tight | loose
    first_failure: tuple[int, int] | None = None  # (sequence, step)
    first_bad_layer: int | None = None
    culprit: str | None = None  # what departs first, in words ("layer 3", "layer 1 expert 5", "the final norm")
    layer_errors: list[float] = field(default_factory=list)  # worst free-running relative error per layer
    layer_local_errors: list[float] = field(default_factory=list)  # worst error on the reference's input
    layer_local_median: list[float] = field(default_factory=list)  # its median over (sequence, position)
    layer_routing: list[int] = field(default_factory=list)  # free-running routing departures per layer
    layer_local_routing: list[int] = field(default_factory=list)  # departures on the reference's input
    layer_forced: list[int] = field(default_factory=list)  # distinct token-layers forced, per layer
    max_abs_err: float = 0.0
    min_cosine: float = 1.0
    routing_forced: int = 0  # distinct (sequence, position, layer) ties where routing took the reference's set
    routing_total: int = 0  # distinct (sequence, position, layer) token-layers
    golden_kv: str = ""
    build_kv: str = ""
    layer_departs: bool = False  # a layer departs (fails at the tight tier)
    blame_threshold: float = BLAME_FACTOR * NOISE_FLOOR["max"]
    blame_threshold_median: float = BLAME_FACTOR * NOISE_FLOOR["median"]
    expert_errors: list[float] = field(default_factory=list)  # worst expert probe error per layer
    experts_failing: list[dict] = field(default_factory=list)  # {layer, expert, error} above EXPERT_TOL
    experts_checked: int = 0
    coverage: list[int] = field(default_factory=list)  # distinct experts the reference routed to, per layer
    tail_norm_error: float | None = None
    tail_lm_head_error: float | None = None
    tail_departs: bool = False
    position_errors: list[list[float]] = field(default_factory=list)  # [sequence][position] max |logit error|
    router_margin: list[dict] = field(default_factory=list)  # per layer: the reference's min / median margin
    texts: list[dict] = field(default_factory=list)  # per sequence: prompt, reference and build continuations
    unmodeled: list[str] = field(default_factory=list)  # compiled-in kernel switches the twins do not model
    prefilled: int = 0  # positions whose KV came from a DI prefill (the decode ran from there on)
    unjudged: int = 0  # positions left unjudged: from a true tie of the reference a compiled program cannot be steered at
    stages: dict = field(default_factory=dict)  # {stage: {"wall": s, "cpu": s}} where the verify's time went
    store_read: dict | None = None  # a store verified in place: {"read": bytes from its blobs, "stored": their size}
    # a dense source's golden: {"scale_rule", "source_layout", "reference": ..., "build": ...} (quality.section),
    # with "tolerance" (--quant-tolerance, or None) and "ok"
    quantization: dict | None = None

    @property
    def quant_fails(self) -> bool:
        q = self.quantization
        return q is not None and not q["ok"]

    def quant_failure(self) -> str:
        """The quantization gate's verdict in words (the build's mean KL from the original)."""
        q, b = self.quantization, self.quantization["build"]
        return (f"the build's mean KL from the {q['source_layout']} original is {b['mean_kl']:.4g} nats, over "
                f"--quant-tolerance {q['tolerance']:g} (worst: sequence {b['worst'][0]} position {b['worst'][1]}, "
                f"{b['max_kl']:.4g} nats; the MXFP4 reference's own mean KL is {q['reference']['mean_kl']:.4g})")

    @property
    def too_many_forced(self) -> bool:
        return self.routing_forced > max(MAX_FORCED * self.routing_total, MIN_FORCED)

    def failure(self) -> str:
        """What failed, in one line: the positions out of tolerance, the first part that departs on
        its own (a layer, an expert, the tail), too many forced routings."""
        what = []
        if self.first_failure:
            what.append(f"sequence {self.first_failure[0]} position {self.first_failure[1]} is out of tolerance")
        if self.layer_departs and self.first_bad_layer is not None:
            i = self.first_bad_layer
            what.append(f"layer {i} departs from the reference (hidden-state error {self.layer_errors[i]:.3g} "
                        f"free-running; on the reference's input {self.layer_local_errors[i]:.3g} at worst, "
                        f"{self.layer_local_median[i]:.3g} at the median, limits {self.blame_threshold:.3g} / "
                        f"{self.blame_threshold_median:.3g}; {self.layer_local_routing[i]} routing departures)")
        if self.experts_failing:
            x = self.experts_failing[0]
            what.append(f"{len(self.experts_failing)} expert(s) depart on the probe rows, first layer {x['layer']} "
                        f"expert {x['expert']} (error {x['error']:.3g})")
        if self.tail_departs:
            what.append(f"the tail departs (final norm error {self.tail_norm_error:.3g}, lm_head error "
                        f"{self.tail_lm_head_error:.3g})")
        if self.too_many_forced:
            what.append(f"routing was forced at true ties on {self.routing_forced} of {self.routing_total} "
                        f"token-layers (more than {MAX_FORCED:.0%})")
        quant = self.quant_fails
        if quant and not what:  # the build is faithful to its MXFP4 reference: only the gate failed
            return f"verify failed: {self.quant_failure()}"
        if quant:
            what.append(self.quant_failure())
        di = f" (decoding from position {self.prefilled} on KV pulled over NIXL)" if self.prefilled else ""
        return (f"verify failed{di}: {'; '.join(what)}; the first part to depart from the reference is "
                f"{self.culprit or 'not one part alone (the logits as a whole)'}")

    def to_dict(self) -> dict:
        """The report as strict JSON values (a non-finite number, e.g. from a build that makes NaN,
        is null)."""
        return _finite_json(self._dict())

    def _dict(self) -> dict:
        return {"ok": self.ok, "tolerances": self.kv, "tie": TIE, "golden_kv": self.golden_kv, "build_kv": self.build_kv,
                "max_abs_err": self.max_abs_err, "min_cosine": self.min_cosine,
                "routing_forced": self.routing_forced, "routing_total": self.routing_total,
                "first_failure": self.first_failure, "first_bad_layer": self.first_bad_layer, "culprit": self.culprit,
                "layer_departs": self.layer_departs, "blame_threshold": self.blame_threshold,
                "blame_threshold_median": self.blame_threshold_median,
                "layer_errors": self.layer_errors, "layer_local_errors": self.layer_local_errors,
                "layer_local_median": self.layer_local_median,
                "layer_routing_departures": self.layer_routing, "layer_local_routing_departures": self.layer_local_routing,
                "layer_forced": self.layer_forced,
                "experts": {"checked": self.experts_checked, "tolerance": EXPERT_TOL, "worst_by_layer": self.expert_errors,
                            "failing": self.experts_failing, "routed_by_layer": self.coverage},
                "tail": {"norm_error": self.tail_norm_error, "lm_head_error": self.tail_lm_head_error,
                         "tolerance": TAIL_TOL, "departs": self.tail_departs},
                "position_errors": self.position_errors, "router_margin": self.router_margin, "texts": self.texts,
                "unmodeled_switches": self.unmodeled, "prefilled": self.prefilled,
                "positions_unjudged": self.unjudged,
                "stages": {k: {"wall": round(v["wall"], 3), "cpu": round(v["cpu"], 3)} for k, v in self.stages.items()},
                "store_read": self.store_read, "quantization": self.quantization,
                "steps": [{"step": s.step, "top1_exact": s.top1_exact, "top1_near": s.top1_near,
                           "top1_wrong": s.top1_wrong, "max_err": {str(k): v for k, v in s.max_err.items()},
                           "min_cosine": s.min_cosine, "top5_overlap": s.top5_overlap, "ok": s.ok}
                          for s in self.steps]}


def compare_position(ours: torch.Tensor, ref: torch.Tensor, tol: dict, div_tol: float) -> tuple[bool, str, dict]:
    """One sequence position: (ok, top-1 verdict exact/near/wrong, max error per tier)."""
    order = leading(ref, max((k for k in tol if k is not None), default=0))
    errs, ok = {}, True
    for k, (atol, rtol) in tol.items():
        idx = slice(None) if k is None else order[:k]
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


def compare(logits: torch.Tensor, ref: torch.Tensor, kv: str, steps_from: int = 0,
            skip: torch.Tensor | None = None) -> Report:
    """logits, ref: [P, T, V]; positions before ``steps_from`` are not judged, nor those ``skip``
    [P, T] marks; ``kv``: the tier."""
    tol, div = TOLERANCES[kv], DIVERGENCE_TOL[kv]
    P, T, _ = ref.shape
    skip = torch.zeros(P, T, dtype=torch.bool) if skip is None else skip
    reports, first = [], None
    for t in range(steps_from, T):
        judged = [p for p in range(P) if not skip[p, t]]
        if not judged:
            continue
        counts = {"exact": 0, "near": 0, "wrong": 0}
        worst = {k: 0.0 for k in tol}
        step_ok = True
        for p in judged:
            ok, verdict, errs = compare_position(logits[p, t], ref[p, t], tol, div)
            counts[verdict] += 1
            worst = {k: max(worst[k], errs[k]) for k in tol}
            if not ok:
                step_ok = False
                first = first or (p, t)
        cos = torch.nn.functional.cosine_similarity(logits[judged, t], ref[judged, t], dim=-1).min()
        k5 = min(5, ref.shape[-1])
        overlap = sum(len(set(logits[p, t].topk(k5).indices.tolist()) & set(ref[p, t].topk(k5).indices.tolist()))
                      for p in judged) / (k5 * len(judged))
        reports.append(StepReport(t, counts["exact"], counts["near"], counts["wrong"], worst, float(cos), step_ok,
                                  overlap))
    rep = Report(reports, first is None, kv, first)
    rep.max_abs_err = max(s.max_err[None] for s in reports)
    rep.min_cosine = min(s.min_cosine for s in reports)
    err = (logits - ref).abs().amax(-1)
    err[:, :steps_from] = float("nan")  # not the build's (a DI prefill's): null in the report
    err[skip] = float("nan")
    rep.position_errors = err.tolist()
    return rep


def relative(ours: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|ours - ref| / |ref| over the last axis; a NaN (a build that makes one) is an infinite error."""
    return torch.nan_to_num((ours - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-12), nan=float("inf"))


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
        texts: list[str] | None = None, chat: bool = False, engine: str = "twin", loose: bool = False,
        other_checkpoint: bool = False, quiet: bool = True, device: str = "cpu", prefill=None,
        trust: list | None = None, quant_tolerance: float | None = None) -> Report:
    """Verify a build against a golden (computed from the build's source, in the build's KV format,
    when none is given: from ``texts`` through the checkpoint's tokenizer, else random token ids),
    running it through the torch twins (``kernels.replay``, every rank emulated), (``engine=
    "compiled"``) its compiled .pt2 programs, or (``engine="neuron"``, on a Trainium host) its NEFFs
    on the NeuronCores. ``other_checkpoint`` accepts a golden made from another checkpoint than the
    build's source (to hold a build of an edited checkpoint to the original model). ``prefill``
    (``di.decode.Prefill``): the prompts' first N-1 positions come from a prefill engine over NIXL
    (``di.decode.pull``); the build then decodes step by step, and is judged, from position N-1 on.
    ``build_dir`` may be a store (``publish.shards``): each file is read from its blob and hashed
    as the twins first need it; ``trust`` (``signing.trust_list``): who must have signed the build.
    ``quant_tolerance`` (nats): fail when the build's mean per-position KL from a dense source's
    original (the golden's ``original_logits``) is above it; refused for a golden without them."""
    from .golden import Golden
    from .pipeline.manifest import checkpoint_hash
    from .runtime import Build

    if device == "cuda" and not torch.cuda.is_available():
        raise GkError("--device cuda: no CUDA device is available on this host")
    from .publish.shards import is_store, open_build, twins_only

    if is_store(build_dir):
        twins_only(build_dir, engine, prefill is not None)
        build = open_build(str(build_dir), trust)
    else:
        build = Build.open(build_dir, trust=trust)
    m = build.manifest
    batch = max(m["recipe"]["resolved"]["decode"]["batch_sizes"])
    if prefill is not None:
        check_prefill(engine)  # before a golden is computed
    if engine == "neuron":
        from .compile import neuron_run

        neuron_run.check(m)  # before a golden is computed: one line where no Trainium is
    fmt = build_kv(m)
    clock = Clock()
    if quant_tolerance is not None and not (quant_tolerance >= 0 and math.isfinite(quant_tolerance)):
        raise GkError(f"--quant-tolerance {quant_tolerance}: give a KL in nats, finite and at least 0")
    if golden is None and quant_tolerance is not None and not m["source"].get("quantize"):
        raise GkError(_NO_ORIGINAL)  # before a golden is computed
    if golden is None:
        from .kernels.driver import check_run

        def fits(positions: int) -> None:  # a run the build cannot hold is refused before any model work
            check_run(m, build.kv_layout(), batch, positions)
        with clock.stage("golden"):
            g = _golden_for(m, fmt, texts, chat, prompts or min(4, batch), prompt_len, steps, device, quiet, fits)
    else:
        with clock.stage("golden"):
            g = golden if isinstance(golden, Golden) else Golden.load(golden)
        want = checkpoint_hash(m["source"]["files"])
        if not other_checkpoint and g.meta.get("checkpoint_sha256") not in (None, want):
            raise GkError(f"{golden}: the golden was made from another checkpoint than this build's source "
                          f"(--allow-other-checkpoint to compare anyway)")
        if not other_checkpoint:
            _check_rule(golden, g.meta, m)
    if quant_tolerance is not None and g.original_logits is None:
        raise GkError(_NO_ORIGINAL)
    kv = tier(g.kv, fmt, loose)
    P, T = g.token_ids.shape
    L = g.hidden.shape[1]
    cfg = m["model"]
    if g.logits.shape[-1] != cfg["vocab_size"] or L != cfg["num_hidden_layers"] or g.hidden.shape[-1] != cfg["hidden_size"] \
            or g.expert_outputs.shape[1] != cfg["num_local_experts"]:
        raise GkError("the golden's model (vocabulary, layers, hidden size or experts) does not match the build's")
    _check_ids(g, cfg)
    if P > batch:
        raise GkError(f"the golden has {P} sequences; the build decodes batches of at most {batch}")
    if engine == "neuron":
        return _on_neuron(build, g, batch, kv, quant_tolerance)
    from . import heap

    heap.reuse_large_blocks()
    try:
        if prefill is None and engine == "twin":
            ours, facts, t0 = *_replay(build, g, batch, engine, device, quiet, clock), 0
        else:
            ours, facts, t0 = _stepwise(build, g, batch, engine, device, quiet, clock, prefill)
    finally:
        build.close()
    with clock.stage("compare"):
        rep = compare(ours, g.logits, kv, steps_from=t0,
                      skip=None if facts.unjudged is None else facts.unjudged[..., -1])
        rep.golden_kv, rep.build_kv = _name(g.kv), _name(fmt)
        rep.prefilled = t0
        _judge(rep, g, facts, kv)
    if g.original_logits is not None:
        with clock.stage("quantization"):
            _quantization(rep, g, ours, t0, facts.unjudged, quant_tolerance)
    with clock.stage("texts"):
        rep.texts = continuations(g, ours.argmax(-1), _tokenizer(m))
    rep.unmodeled = unmodeled_switches(m)
    rep.stages = clock.spent
    rep.store_read = build.store_read
    return rep


_NO_ORIGINAL = ("--quant-tolerance: the golden holds no dense original's logits (it is not of a bf16/fp32 source), "
                "so there is nothing to measure the quantization against")


def _rule_of(meta: dict | None) -> str | None:
    return (meta or {}).get("scale_rule")


def _check_rule(golden, meta: dict, m: dict) -> None:
    """A golden's quantization must be the build's: the same scale rule over a dense source (or none
    on both sides), else one line."""
    ours, theirs = _rule_of(m["source"].get("quantize")), _rule_of(meta.get("quantize"))
    if ours != theirs:
        said = lambda r: f"scale rule {r}" if r else "none (an MXFP4 source)"  # noqa: E731
        raise GkError(f"{golden}: the golden's quantization is {said(theirs)}, the build's {said(ours)}; make the "
                      f"golden with the build's rule"
                      + (f" (gkbuild golden --scale-rule {ours})" if ours else "")
                      + " (--allow-other-checkpoint to compare anyway)")


def _quantization(rep: Report, g, ours: torch.Tensor, t0: int, unjudged, tolerance: float | None) -> None:
    """The quantization section (``quality.section``) of a dense source's golden, and its gate."""
    from . import quality

    P, T = g.token_ids.shape
    keep = torch.ones(P, T, dtype=torch.bool)
    keep[:, :t0] = False  # a DI prefill's positions are not the build's
    if unjudged is not None:
        keep &= ~unjudged[..., -1]
    q = quality.section(g.original_logits, g.logits, ours, keep)
    quantize = g.meta.get("quantize") or {}
    q.update(scale_rule=quantize.get("scale_rule"), source_layout=quantize.get("source_layout", "dense"),
             tolerance=tolerance)
    mean = q["build"]["mean_kl"]
    q["ok"] = tolerance is None or (mean is not None and mean <= tolerance)
    rep.quantization = q
    rep.ok = rep.ok and q["ok"]


def _tokenizer(m: dict):
    from . import text
    from .checkpoint.source import parse

    try:
        return text.local_tokenizer(parse(m["source"]["uri"], base=Path.cwd()))
    except GkError:
        return None


def continuations(g, predicted: torch.Tensor, tok=None) -> list[dict]:
    """Per sequence: its prompt, the reference's continuation and the build's (its argmax at each
    position, teacher-forced), as text when a tokenizer is at hand, else token ids."""
    from . import text

    show = (lambda ids: text.decode(tok, ids)) if tok is not None else (lambda ids: " ".join(map(str, ids)))  # noqa: E731
    out = []
    for p, n in enumerate(g.prompt_lens):
        ref, ours = g.token_ids[p, n:].tolist(), predicted[p, n - 1:-1].tolist()
        out.append({"prompt": g.prompts[p] if g.prompts else show(g.token_ids[p, :n].tolist()),
                    "reference": show(ref), "build": show(ours), "agree": sum(a == b for a, b in zip(ref, ours)),
                    "length": len(ref)})
    return out


def _golden_for(m: dict, fmt: KvFormat, texts, chat: bool, n: int, prompt_len: int, steps: int, device: str,
                quiet: bool, fits):
    """The golden of the build's source in the build's KV format; ``fits(positions)`` refuses a
    run the build cannot hold, called once the length is known (text prompts: their token count)."""
    from .checkpoint.source import open_source, parse
    from .golden import default_prompts, for_checkpoint
    from .reference import build_rule

    rule = build_rule(m)
    # A folder source is recorded as the recipe wrote it: relative paths resolve from here.
    spec = parse(m["source"]["uri"], base=Path.cwd())
    if texts:
        from . import text

        ids = text.encode(text.tokenizer(spec), texts, chat)
        fits(max(map(len, ids)) + steps)
        return for_checkpoint(open_source(spec), ids, steps, fmt, device, quiet, {"prompts": list(texts), "chat": chat},
                              rule=rule)
    fits(prompt_len + steps)
    return for_checkpoint(open_source(spec), default_prompts(m["model"]["vocab_size"], n, prompt_len), steps, fmt,
                          device, quiet, rule=rule)


@dataclass
class _Facts:
    """What a run of the build saw, besides its logits (``[P, T, L]`` per token-layer)."""

    errors: torch.Tensor  # free-running hidden-state relative error
    local: torch.Tensor | None  # the same on the reference's input (None: the engine runs every layer at once)
    departed: torch.Tensor  # free-running routing departures
    local_departed: torch.Tensor | None
    forced: torch.Tensor  # routing took the reference's set at a tie (free-running)
    probes: torch.Tensor  # [L, E, n, H] every expert on the probe rows
    norm: torch.Tensor  # [P, T] the tail's final norm against the reference's
    lm_head: torch.Tensor  # [P, T] the tail's logits from the reference's norm output
    # [P, T, L]: not judged where the reference's routing is at a true tie and the engine cannot be
    # steered to its set (a compiled program): that layer and those above, and every later position of
    # the sequence (the other set's K/V feeds them); either set is the model's
    unjudged: torch.Tensor | None = None


def _replay(build, g, batch: int, engine: str, device: str, quiet: bool, clock: Clock):
    """The twins, layer-major (``kernels.replay``): logits [P, T, V] and the facts."""
    from .kernels.driver import Session
    from .kernels.replay import Replay, live_rows

    P, T = g.token_ids.shape
    L = g.hidden.shape[1]
    m = build.manifest
    with clock.stage("open"):
        session = Session(build, batch, max_len=T, compact_kv=True, kv=False)
        rp = Replay(session, live_rows(batch, m["topology"]["dp"], P), T, device)
    E = m["model"]["num_local_experts"]
    f = _empty_facts(P, T, L, g, local=True)
    per_layer = lambda i: (1 if i == 0 else 2) * T + E  # noqa: E731 - progress units of layer i
    with steps_bar("verify", sum(per_layer(i) for i in range(L)) + T, quiet) as advance:
        with clock.stage("embed"):
            rp.embed(g.token_ids.T)
        with rp.experts_ahead(AHEAD_BYTES):
            _layers(rp, g, f, clock, advance)
        with clock.stage("tail"):
            logits = rp.tail(advance)  # [T, P, V]
    with clock.stage("tail check"):
        f.norm, f.lm_head = _tail_check(session, g)
    return logits.transpose(0, 1), f


def _layers(rp, g, f: _Facts, clock: Clock, advance) -> None:
    """Every layer through the replay, both streams, its facts into ``f``."""
    from .kernels.replay import FREE

    for i in range(g.hidden.shape[1]):
        ref_in = None if i == 0 else g.hidden[:, i - 1].transpose(0, 1)  # [T, P, H]
        with clock.stage("layers"):
            out = rp.layer(i, ref_in, g.routing[:, i].transpose(0, 1), g.router_gap[:, i].T, g.expert_inputs,
                           TIE, advance)
        ref = g.hidden[:, i].transpose(0, 1)
        # the last stream is the layer on the reference's input (layer 0: its input is the embedding either way)
        f.errors[..., i], f.local[..., i] = relative(out.hidden[FREE], ref).T, relative(out.hidden[-1], ref).T
        f.departed[..., i], f.local_departed[..., i] = out.departed[FREE].T, out.departed[-1].T
        f.forced[..., i] = out.taken[FREE].T
        f.probes[i] = out.probes


def _stepwise(build, g, batch: int, engine: str, device: str, quiet: bool, clock: Clock, prefill=None):
    """Decode steps as a runtime drives them (the compiled programs, world size 1, or the twins after
    a DI prefill): logits [P, T, V], the facts (no local stream: a step runs every layer at once)
    and the first position decoded (N-1 after a prefill, else 0)."""
    from .kernels.decode import RoutingGuide
    from .kernels.driver import Session
    from .kernels.replay import live_rows, probe_experts

    if device != "cpu":
        raise GkError(f"{'--prefill nixl' if prefill is not None else '--engine compiled'} runs on the cpu here; "
                      f"use --engine twin with --device cuda")
    P, T = g.token_ids.shape
    L = g.hidden.shape[1]
    rows = live_rows(batch, build.manifest["topology"]["dp"], P)
    pick = torch.zeros(batch, dtype=torch.int64)  # the rows without a sequence run sequence 0's tokens
    pick[rows] = torch.arange(P)
    with clock.stage("open"):
        session = Session(build, batch, max_len=T, engine=engine, compact_kv=True)
    t0 = 0
    if prefill is not None:
        from .di.decode import pull

        with clock.stage("prefill"):
            t0 = pull(build, session, g.token_ids[:, :g.prompt_len].tolist(), pick, prefill, quiet)
    ours = torch.zeros(P, T, g.logits.shape[-1])
    f = _empty_facts(P, T, L, g, local=False)
    with clock.stage("steps"), steps_bar("verify", (T - t0) * L, quiet) as advance:
        for t in range(t0, T):
            guide = RoutingGuide(g.routing[pick, :, t].transpose(0, 1), g.router_gap[pick, :, t].T, TIE)
            res = session.step(g.token_ids[pick, t], collect_hiddens=True, guide=guide,
                               on_layer=lambda i, t=t: advance(1, f"position {t + 1}/{T}, layer {i + 1}/{L}"))
            ours[:, t] = res.logits[rows]
            f.errors[:, t] = torch.stack([relative(h[rows], g.hidden[:, i, t]) for i, h in enumerate(res.hiddens)], -1)
            f.departed[:, t], f.forced[:, t] = guide.departed[:, rows].T, guide.taken[:, rows].T
    if engine == "compiled":  # a program takes no routing guide: at a true tie of the reference either set is right
        tie = (g.router_gap <= TIE).permute(0, 2, 1)  # [P, T, L]
        at = tie.any(-1)  # [P, T]
        after = (at.cumsum(1) - at.int()) > 0  # [P, T]: a later position of that sequence
        # the tie's layer and those above it, and through the KV every later position of the sequence
        f.forced, f.unjudged = tie, tie.cummax(-1).values | after[..., None]  # every tie counts against the cap
    with clock.stage("probes"):
        for i in range(L):
            f.probes[i] = probe_experts(session, i, g.expert_inputs)
    with clock.stage("tail check"):
        f.norm, f.lm_head = _tail_check(session, g)
    return ours, f, t0


def _empty_facts(P: int, T: int, L: int, g, local: bool) -> _Facts:
    z, b = (lambda: torch.zeros(P, T, L)), (lambda: torch.zeros(P, T, L, dtype=torch.bool))
    return _Facts(z(), z() if local else None, b(), b() if local else None, b(), torch.zeros_like(g.expert_outputs),
                  torch.zeros(P, T), torch.zeros(P, T))


def _tail_check(session, g) -> tuple[torch.Tensor, torch.Tensor]:
    """The tail on the reference's numbers: its final norm on the reference's last hidden state and
    its lm_head on the reference's norm output, as relative errors [P, T]."""
    from .kernels.replay import tail_on

    P, T = g.token_ids.shape
    norm, logits = tail_on(session, g.hidden[:, -1].reshape(P * T, -1), g.final_norm.reshape(P * T, -1),
                           lambda normed: relative(normed, g.final_norm.reshape(P * T, -1)))
    return norm.reshape(P, T), relative(logits, g.logits.reshape(P * T, -1)).reshape(P, T)


def _judge(rep: Report, g, f: _Facts, kv: str) -> None:
    """Fill the report from the facts and decide: which part departs first, and the verdict."""
    t0 = rep.prefilled  # positions before it are a DI prefill's, not the build's
    if t0:
        f = replace(f, errors=f.errors[:, t0:], departed=f.departed[:, t0:], forced=f.forced[:, t0:],
                    norm=f.norm[:, t0:], lm_head=f.lm_head[:, t0:],
                    unjudged=None if f.unjudged is None else f.unjudged[:, t0:])
    if f.unjudged is not None:  # left out of every layer statistic (NaN is ignored below)
        f = replace(f, errors=f.errors.masked_fill(f.unjudged, float("nan")))
        rep.unjudged = int(f.unjudged[..., -1].sum())
    P, T, L = f.errors.shape
    local = f.local if f.local is not None else f.errors
    local_departed = f.local_departed if f.local_departed is not None else f.departed
    rep.layer_errors = f.errors.nan_to_num(nan=0.0).amax(dim=(0, 1)).tolist()
    rep.layer_local_errors = local.nan_to_num(nan=0.0).amax(dim=(0, 1)).tolist()
    rep.layer_local_median = local.reshape(-1, L).nanmedian(0).values.tolist()
    rep.layer_routing = f.departed.sum(dim=(0, 1)).tolist()
    rep.layer_local_routing = local_departed.sum(dim=(0, 1)).tolist()
    rep.layer_forced = f.forced.sum(dim=(0, 1)).tolist()
    rep.routing_forced, rep.routing_total = int(f.forced.sum()), P * T * L
    expert_err = relative(f.probes, g.expert_outputs).amax(-1)  # [L, E]
    rep.expert_errors = expert_err.amax(-1).tolist()
    rep.experts_checked = expert_err.numel()
    rep.experts_failing = [{"layer": int(i), "expert": int(e), "error": float(expert_err[i, e])}
                           for i, e in torch.nonzero(expert_err > EXPERT_TOL).tolist()]
    rep.coverage = [len(torch.unique(g.routing[:, i])) for i in range(L)]
    gap = g.router_gap
    rep.router_margin = [{"min": _finite(gap[:, i].min()), "median": _finite(gap[:, i].median())} for i in range(L)]
    rep.tail_norm_error, rep.tail_lm_head_error = float(f.norm.max()), float(f.lm_head.max())
    rep.tail_departs = rep.tail_norm_error > TAIL_TOL or rep.tail_lm_head_error > TAIL_TOL
    departs = [(rep.layer_local_errors[i] > rep.blame_threshold or rep.layer_local_median[i] > rep.blame_threshold_median,
                rep.layer_local_routing[i] > 0, rep.expert_errors[i] > EXPERT_TOL) for i in range(L)]
    first = next((i for i, d in enumerate(departs) if any(d)), None)
    # a free-running departure above LAYER_TOL (or a routing departure) fails the tight tier too
    free = next((i for i in range(L) if rep.layer_errors[i] > LAYER_TOL[kv] or rep.layer_routing[i]), None)
    rep.layer_departs = kv == "tight" and (first is not None or free is not None)
    rep.ok = rep.ok and not rep.too_many_forced and not rep.layer_departs and not rep.tail_departs
    if rep.ok:
        return
    if first is not None:
        rep.first_bad_layer = first
        what = [w for w, d in zip(("hidden state", "routing", "experts " + ", ".join(
            str(x["expert"]) for x in rep.experts_failing if x["layer"] == first)), departs[first]) if d]
        rep.culprit = f"layer {first} ({'; '.join(what)})"
    elif rep.tail_departs:
        rep.culprit = "the final norm" if rep.tail_norm_error > TAIL_TOL else "the lm_head"
    elif free is not None:
        rep.first_bad_layer = free
        rep.culprit = f"layer {free} (free-running)"


def _finite(x) -> float | None:
    v = float(x)
    return v if math.isfinite(v) else None


def _finite_json(x):
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite_json(v) for v in x]
    return x


def _on_neuron(build, g, batch: int, kv: str, quant_tolerance: float | None = None) -> Report:
    """The Neuron programs on this host's NeuronCores (``compile.neuron_run``): logits only, so the
    report has no per-layer attribution; every replica of a sequence must agree (keep the worst)."""
    import tempfile

    from .compile import neuron_run

    with tempfile.TemporaryDirectory(prefix="gkbuild-neuron-") as tmp:
        golden_path = Path(tmp) / "golden.safetensors"
        g.save(golden_path)
        logits = neuron_run.run(build, golden_path, batch, Path(tmp) / "out")  # [batch, T, V]
    P, T = g.token_ids.shape
    rows = torch.arange(batch) % P
    ours = torch.empty(P, T, g.logits.shape[-1])
    for p in range(P):
        mine = logits[rows == p]
        worst = (mine - g.logits[p]).abs().amax(dim=(1, 2)).argmax()
        ours[p] = mine[worst]
    rep = compare(ours, g.logits, kv)
    if g.original_logits is not None:
        _quantization(rep, g, ours, 0, None, quant_tolerance)
    return rep

