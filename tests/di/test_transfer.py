"""`verify --prefill nixl`, for real: a prefill engine in its own process on 127.0.0.1 computes the
prompts' first N-1 positions (the streamed reference, the build's KV format, seed 000's per-buffer
layout, its regions registered with NIXL), the decode side pulls every block the plan names with
NIXL READs over UCX/TCP and decodes from position N-1 with the twins, all 128 ranks of
tiny-topology-trn3 emulated. Both KV forms, FP8 and bf16, at the prompt lengths the SWA N-1 rule
needs; every fault of the catalogue fails and names its layer; a transfer that errors or times
out is one line and no decode step runs."""

import os
import signal
import time

import pytest

from gkbuild import recipe, reference, verify
from gkbuild.checkpoint.source import materialize, parse
from gkbuild.di import decode as di_decode
from gkbuild.di import nixl
from gkbuild.di.decode import Prefill, prefill_args, prefill_process
from gkbuild.di.plan import covering_lengths
from gkbuild.errors import GkError
from gkbuild.golden import default_prompts, for_checkpoint
from gkbuild.kernels.driver import Session
from gkbuild.pipeline.pipeline import compile_build
from gkbuild.runtime import Build
from tests.conftest import RECIPES, run_cli
from tests.di.fake_prefill import MARGIN, fake_prefill, scripted
from tests.di.faults import CATALOGUE

pytestmark = pytest.mark.usefixtures("one_thread")

BF16 = ["kv_cache.dtype=bf16", "kv_cache.packed=false"]
BUILDS = {"stacked-fp8": [], "paired-fp8": ["kv_cache.form=paired"], "stacked-bf16": BF16,
          "paired-bf16": ["kv_cache.form=paired", *BF16]}
LENGTHS = covering_lengths(4, 8)  # tiny-topology: block 4, window 8 -> [12, 15]
STEPS = 1  # positions N-1 and N are decoded and judged
PROMPTS = 4
SOURCE = "synth://tiny-topology?layers=2&seed=0"


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    root = tmp_path_factory.mktemp("di")
    for name, sets in BUILDS.items():
        compile_build(recipe.load(RECIPES / "tiny-topology-trn3.yaml", sets), out=root / name, quiet=True,
                      compile=False)
    return {name: root / name for name in BUILDS}


@pytest.fixture(scope="module")
def goldens(builds):
    """A golden a KV format and prompt length, shared by both forms."""
    ck = materialize(parse(SOURCE))
    out = {}
    for dtype in ("fp8", "bf16"):
        fmt = reference.build_kv(Build.open(builds[f"stacked-{dtype}"]).manifest)
        for n in LENGTHS:
            out[dtype, n] = for_checkpoint(ck, default_prompts(2048, PROMPTS, n), STEPS, fmt)
    return out


@pytest.fixture(scope="module")
def engines(builds):
    """One prefill engine (a process) a KV format, serving every run of the module."""
    import contextlib

    with contextlib.ExitStack() as stack:
        out = {}
        for dtype in ("fp8", "bf16"):
            b = Build.open(builds[f"stacked-{dtype}"])
            blocks = di_decode.pool_blocks(PROMPTS, max(LENGTHS), 4, 8)
            out[dtype] = stack.enter_context(prefill_process(prefill_args(b, 4, blocks)))
        yield out


@pytest.fixture
def no_steps(monkeypatch):
    """Records every decode step a session runs."""
    calls = []
    orig = Session.step
    monkeypatch.setattr(Session, "step", lambda self, *a, **k: (calls.append(1), orig(self, *a, **k))[1])
    return calls


def _bytes_expected(n: int) -> int:
    """Bytes a tiny-topology pull moves, counted from the build's shapes alone: every one of the
    128 ranks' 8 rows reads, for its one full layer, the blocks of n positions and, for its one
    sliding layer, the window's blocks at a first query at n; K and V; 4 x 32 bytes a block and
    head, twice that at bf16."""
    block, window = 4, 8
    full = -(-n // block)
    first = max(0, n - window + 1) // block
    return 128 * 8 * (full + (full - first)) * 2 * block * 32


@pytest.mark.parametrize("n", LENGTHS, ids=[f"N{n}" for n in LENGTHS])
@pytest.mark.parametrize("name", list(BUILDS))
def test_a_nixl_prefill_passes_tightly(builds, goldens, engines, name, n):
    dtype = name.split("-")[1]
    spec = Prefill(endpoint=engines[dtype][0])
    rep = verify.run(builds[name], golden=goldens[dtype, n], prefill=spec)
    assert rep.ok and rep.kv == "tight", rep.to_dict()
    assert rep.prefilled == n - 1 and [s.step for s in rep.steps] == [n - 1, n]
    assert rep.max_abs_err <= 0.05 and max(rep.layer_errors) < verify.LAYER_TOL["tight"] / 5
    assert rep.routing_forced <= 0.02 * rep.routing_total and not any(rep.layer_routing)
    assert spec.stats["computed"] == n - 1
    assert spec.stats["bytes"] == _bytes_expected(n - 1) * (2 if dtype == "bf16" else 1)


def _first_step_only(g):
    """The golden up to the prompt's last position: the decode runs one step, at N-1 (where every
    fault of the prompt's KV shows)."""
    import dataclasses

    n = g.prompt_len
    return dataclasses.replace(g, token_ids=g.token_ids[:, :n], logits=g.logits[:, :n], hidden=g.hidden[:, :, :n],
                               routing=g.routing[:, :, :n], router_gap=g.router_gap[:, :, :n],
                               final_norm=g.final_norm[:, :n])


@pytest.mark.parametrize("fault", CATALOGUE, ids=[f.name for f in CATALOGUE])
def test_every_fault_fails_naming_its_layer(builds, goldens, engines, fault):
    n = LENGTHS[1]  # N % block == block - 1: where the N-1 rule matters
    rep = verify.run(builds["stacked-fp8"], golden=_first_step_only(goldens["fp8", n]),
                     prefill=Prefill(endpoint=engines["fp8"][0], edit=fault.edit))
    assert not rep.ok and rep.first_bad_layer == fault.layer, (fault.name, rep.layer_errors)
    msg = rep.failure()
    assert f"layer {fault.layer} departs from the reference (hidden-state error" in msg, msg
    assert f"the first part to depart from the reference is layer {fault.layer} (" in msg, msg
    assert "decoding from position 14 on KV pulled over NIXL" in msg and "\n" not in msg


def test_the_n_minus_1_rule_only_shows_at_its_boundary(builds, goldens, engines):
    """Away from N % block == block - 1 the window at N and at N-1 hold the same blocks: a prompt
    of 12 cannot tell; the catalogue's prompt of 15 does."""
    from tests.di.faults import no_n_minus_1

    rep = verify.run(builds["paired-fp8"], golden=_first_step_only(goldens["fp8", 12]),
                     prefill=Prefill(endpoint=engines["fp8"][0], edit=no_n_minus_1))
    assert rep.ok, rep.to_dict()


def _warm(build, endpoint, g) -> None:
    """The engine computes ``g``'s prompts now (it keeps the last prompts' K/V): a test with a
    short deadline then times the exchange it is about, not the reference's first run."""
    b = Build.open(build)
    peer = di_decode.Peer(endpoint, timeout=300)
    try:
        peer.check(di_decode.plan_of(b, 4), reference.build_kv(b.manifest))
        peer.release(peer.prefill(g.token_ids[:, :g.prompt_len].tolist())["round"])
    finally:
        peer.close()
        b.close()


def test_a_stalled_prefill_times_out_in_one_line_and_no_step_runs(builds, goldens, engines, monkeypatch, no_steps):
    """The prefill process stopped (SIGSTOP) after it answered: its UCX worker serves no READ."""
    endpoint, proc = engines["fp8"]
    _warm(builds["stacked-fp8"], endpoint, goldens["fp8", 12])
    orig = di_decode._read

    def stop_then_read(*a, **k):
        os.kill(proc.pid, signal.SIGSTOP)
        return orig(*a, **k)

    monkeypatch.setattr(di_decode, "_read", stop_then_read)
    try:
        t = time.monotonic()
        with pytest.raises(GkError) as e:
            verify.run(builds["stacked-fp8"], golden=goldens["fp8", 12], prefill=Prefill(endpoint=endpoint, timeout=2))
        assert time.monotonic() - t < 60
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    msg = str(e.value)
    assert msg.startswith("NIXL READ timed out after 2 s: 4 of 4 transfers not done (from gk-prefill-")
    assert msg.endswith("no decode step ran on the partial cache") and "\n" not in msg
    assert not no_steps


def test_a_prefill_that_dies_mid_transfer_is_one_line_and_no_step_runs(builds, goldens, monkeypatch, no_steps):
    b = Build.open(builds["stacked-fp8"])
    with prefill_process(prefill_args(b, 4, 64)) as (endpoint, proc):
        orig = nixl.Reads.wait

        def kill_then_wait(self, *a, **k):
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            return orig(self, *a, **k)

        monkeypatch.setattr(nixl.Reads, "wait", kill_then_wait)
        with pytest.raises(GkError) as e:
            verify.run(builds["stacked-fp8"], golden=goldens["fp8", 12], prefill=Prefill(endpoint=endpoint, timeout=30))
    msg = str(e.value)
    assert msg.startswith("NIXL READ from gk-prefill-") and " failed" in msg, msg
    assert msg.endswith("no decode step ran on the partial cache") and "\n" not in msg
    assert not no_steps


def test_a_prefill_silent_after_the_transfer_is_one_line_at_the_deadline(builds, goldens, engines, tmp_path,
                                                                        monkeypatch, no_steps):
    """A prefill that serves every READ but never acknowledges the release of its blocks (a fake
    in front of the real engine swallows ``release``): the release's deadline ends the pull."""
    took = []
    release = di_decode.Peer.release

    def timed(self, rnd):
        t = time.monotonic()
        try:
            return release(self, rnd)
        finally:
            took.append(time.monotonic() - t)

    _warm(builds["stacked-fp8"], engines["fp8"][0], goldens["fp8", 12])
    monkeypatch.setattr(di_decode.Peer, "release", timed)
    with fake_prefill(tmp_path, "proxy", str(engines["fp8"][0][1]), "--drop", "release") as (endpoint, log):
        spec = Prefill(endpoint=endpoint, timeout=5)
        with pytest.raises(GkError) as e:
            verify.run(builds["stacked-fp8"], golden=goldens["fp8", 12], prefill=spec)
        assert log.read_text().splitlines()[:4] == ["connect", "recv hello", "recv prefill", "recv release"]
    assert str(e.value) == (f"prefill at {endpoint[0]}:{endpoint[1]}: the release did not complete within 5 s "
                            f"(--transfer-timeout); no decode step ran")
    assert len(took) == 1 and 5 <= took[0] < 5 + MARGIN, took
    assert not no_steps


def test_a_prefill_that_computed_nothing_fails_naming_what_is_missing(builds, goldens, engines, tmp_path, no_steps):
    """A prefill answering ``computed: 0`` (a fake in front of the real engine rewrites its
    reply): the verify fails, where it used to pass having moved 0 bytes."""
    with fake_prefill(tmp_path, "proxy", str(engines["fp8"][0][1]), "--set", "prefilled.computed=0") as (ep, _):
        with pytest.raises(GkError) as e:
            verify.run(builds["stacked-fp8"], golden=goldens["fp8", 12], prefill=Prefill(endpoint=ep, timeout=30))
    assert str(e.value) == (f"prefill at {ep[0]}:{ep[1]}: the prefill computed 0 positions of prompts of 12 tokens; "
                            f"the run needs their first 11 (N-1); no decode step ran")
    assert not no_steps


def test_a_plan_that_reads_part_of_a_block_fails_before_any_transfer(builds, goldens, engines, monkeypatch,
                                                                      no_steps):
    """A plan whose reads leave a block part-filled (layer 1's V: none) is refused before a READ
    is posted, naming the layer, half and bytes."""
    posted = []
    monkeypatch.setattr(nixl.Reads, "post", lambda self, *a: posted.append(a))

    def drop_layer_1_v(plan):
        for r in plan["ranks"]:
            for rd in r["reads"]:
                if (rd["layer"], rd["half"]) == (1, "V"):
                    rd["segments"] = []
        return plan

    with pytest.raises(GkError) as e:
        verify.run(builds["stacked-fp8"], golden=goldens["fp8", 12],
                   prefill=Prefill(endpoint=engines["fp8"][0], edit=drop_layer_1_v))
    assert str(e.value) == ("the transfer plan falls short on decode rank 0, row 0: layer 1's V would receive 0 bytes "
                            "of the 384 its 3 full blocks hold after 11 prefilled positions; nothing was transferred; "
                            "no decode step ran")
    assert not posted and not no_steps


def test_a_run_past_the_kv_budget_is_refused_before_any_work(builds, tmp_path, monkeypatch):
    """Paired draws a layer pair's sliding blocks apart from its full ones: a DI verify of 40 steps
    after prompts of 15 (55 positions) needs 8 sequences x (14 full + 3 sliding: the window's 2
    and the one being taken) = 136 blocks of the paired build's 96. Refused with the numbers
    before a golden is computed, a prefill process started or the peer reached."""
    import gkbuild.golden

    computed, started = [], []
    monkeypatch.setattr(gkbuild.golden, "for_checkpoint", lambda *a, **k: computed.append(1))
    monkeypatch.setattr(di_decode, "prefill_process", lambda *a, **k: started.append(1))
    want = ("the build's KV budget is too small for this run: 8 sequences a DP replica over 55 positions need 136 "
            "blocks of 4 in the paired form, the build has kv_cache.num_blocks 96; run fewer positions or rebuild with "
            "kv_cache.num_blocks >= 136")
    with scripted(tmp_path, []) as (endpoint, log):
        with pytest.raises(GkError) as e:
            verify.run(builds["paired-fp8"], steps=40, prompt_len=15, prefill=Prefill(endpoint=endpoint))
        assert str(e.value) == want
        assert log.read_text() == ""  # never connected
    with pytest.raises(GkError) as e:  # the command line's own prefill engine: never started
        with di_decode.serving(builds["paired-fp8"], 4, None, None, 5, steps=40):
            pass
    assert str(e.value) == want
    assert not computed and not started


def test_without_nixl_verify_says_what_to_install(builds, monkeypatch, tmp_path):
    import gkbuild.golden

    monkeypatch.setattr(nixl, "MODULES", ("gkbuild_no_such_nixl",))
    computed = []
    monkeypatch.setattr(gkbuild.golden, "for_checkpoint", lambda *a, **k: computed.append(1))
    with pytest.raises(GkError, match=r"--prefill nixl needs NIXL, which is not installed: pip install 'gkbuild\[di\]'"):
        verify.run(builds["stacked-fp8"], prefill=Prefill())
    assert not computed  # refused before a golden is computed
    # the command line, where the package itself cannot be imported
    shadow = tmp_path / "shadow"
    for mod in ("nixl_cu12", "nixl_cu13", "nixl"):
        (shadow / mod).mkdir(parents=True)
        (shadow / mod / "__init__.py").write_text("raise ImportError('not installed here')\n")
    r = run_cli("verify", str(builds["stacked-fp8"]), "--prefill", "nixl",
                env={"PYTHONPATH": f"{shadow}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        "gkbuild: error: --prefill nixl needs NIXL, which is not installed: pip install 'gkbuild[di]' (NIXL's Python "
        "API, nixl-cu12, with torch pinned)"]


def test_a_prefill_engine_that_cannot_start_is_one_line(builds):
    b = Build.open(builds["stacked-fp8"])
    args = prefill_args(b, 3, 16)
    with pytest.raises(GkError, match=r"the prefill process exited \(1\): gkbuild prefill: error: --tp 3: 8 kv heads "
                                      r"do not split over it"):
        with prefill_process(args):
            pass


@pytest.mark.slow
def test_the_command_line_runs_both_boundary_lengths_with_its_own_prefill_process(builds):
    """`gkbuild verify BUILD --prefill nixl`: the prefill engine is started and stopped by the
    command; without a golden it runs the prompt lengths the SWA N-1 rule needs (12 and 15)."""
    r = run_cli("verify", str(builds["paired-fp8"]), "--prefill", "nixl", "--steps", "1", "--prompts", "1", "-q")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("positions 0..10 prefilled, pulled over NIXL") == 1
    assert r.stdout.count("positions 0..13 prefilled, pulled over NIXL") == 1
