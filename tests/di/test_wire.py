"""The DI side channel is data from another process: every hostile answer is one line, before
anything is allocated from it or a descriptor is built; a peer that stalls is one line within the
deadline. The peer is a fake prefill process on 127.0.0.1 (``fake_prefill``)."""

import json
import struct
import time

import pytest

from gkbuild.di import plan as di
from gkbuild.di.decode import Peer
from gkbuild.errors import GkError
from gkbuild.reference import KvFormat
from tests.conftest import RECIPES
from tests.di.fake_prefill import frame as _frame
from tests.di.fake_prefill import MARGIN, scripted


def _plan() -> dict:
    from gkbuild import recipe
    from gkbuild.model import preset
    from gkbuild.pipeline.pipeline import layout_docs
    from gkbuild.plan import make_plan

    p = make_plan(recipe.load(RECIPES / "tiny-topology-trn3.yaml"), preset("tiny-topology"))
    return di.transfer_plan(json.loads(json.dumps(layout_docs(p)["layout/kv.json"])), 4, 8)


PLAN = _plan()
FMT = KvFormat("fp8_e4m3", 1.0, 1.0)


def _engine(**over) -> dict:
    e = {"tp": 4, "kv": FMT.to_meta(), "block_size": 4, "num_blocks": 16, "num_layers": 2, "kv_heads": 8,
         "head_dim": 32, "window": 8, "block_len": 256, "buffers": 1, "layout": "per_buffer"}
    return {**e, **over}


def _ranks(**over) -> list:
    return [{"rank": p, "agent": f"a{p}", "heads": [2 * p, 2 * p + 1], "metadata": "",
             "regions": [{"index": k, "addr": 4096 * (k + 1), "len": 16 * 256} for k in range(2)], **over}
            for p in range(4)]


def _frame_raw(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


def _hello(**over) -> bytes:
    return _frame({"op": "hello", "version": 1, "engine": _engine(), "ranks": _ranks(), **over})


@pytest.mark.parametrize("answer,message", [
    (struct.pack(">I", 1 << 30), "the peer sent a 1073741824-byte frame, over the 67108864-byte limit"),
    (struct.pack(">I", 3) + b"{x}", "a frame from the peer: not valid JSON"),
    (_frame_raw(b"[" * 100 + b"]" * 100), "a frame from the peer: nested deeper than 64 levels"),
    (_frame_raw(b'{"op": NaN}'), "a frame from the peer: not valid JSON (NaN is not strict JSON)"),
    (_frame([1, 2]), "the peer sent [1, 2], not a message"),
    (_frame({"op": "error", "message": "prefill: out of blocks"}), "prefill: out of blocks"),
    (_hello(version=2), "speaks side-channel version 2, not 1"),
    (_frame({"op": "hello", "version": 1}), "a hello without its engine and ranks"),
    (b"", "the peer closed the connection"),
])
def test_a_hostile_hello_is_one_line(tmp_path, answer, message):
    with scripted(tmp_path, [answer]) as (endpoint, _), pytest.raises(GkError) as e:
        Peer(endpoint, timeout=5)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("engine,ranks,message", [
    (_engine(kv=KvFormat("bf16").to_meta()), _ranks(), "its kv is"),
    (_engine(block_size=8), _ranks(), "its block_size is 8, the build's plan needs 4"),
    (_engine(num_blocks=-1), _ranks(), "num_blocks is -1"),
    (_engine(), _ranks()[:3], "3 ranks described, its TP is 4"),
    (_engine(), _ranks(regions=[]), "rank 0 registers [], not the plan's 2 regions"),
    (_engine(), _ranks(heads=[0]), "rank 0 holds kv heads [0], the plan reads [0, 1]"),
    (_engine(), _ranks(regions=[{"addr": -5, "len": 4096}] * 2), "rank 0 region address is -5"),
    (_engine(), _ranks(regions=[{"addr": 1, "len": 10}] * 2), "rank 0's regions are not 16 blocks of 256 bytes"),
])
def test_an_engine_that_is_not_the_plans_is_refused(tmp_path, engine, ranks, message):
    with scripted(tmp_path, [_frame({"op": "hello", "version": 1, "engine": engine, "ranks": ranks})]) as (ep, _):
        peer = Peer(ep)
        with pytest.raises(GkError) as e:
            peer.check(PLAN, FMT)
        peer.close()
    assert message in str(e.value) and "\n" not in str(e.value)


def _prefilled(**over) -> bytes:
    return _frame({"op": "prefilled", "round": 0, "computed": 5, "requests": [{"full": [0, 1], "swa": {"1": 2}}],
                   **over})


@pytest.mark.parametrize("reply,message", [
    (_prefilled(requests=[{"full": [0, 99], "swa": {}}]), "a block id is 99; expected an integer in 0..15"),
    (_prefilled(requests=[{"full": [0, 1], "swa": {"x": 1}}]), "a logical block is 'x'; expected ASCII decimal digits"),
    # str.isdigit() takes both: "²" was a ValueError traceback, "١" (Arabic-Indic one) silently block 1
    (_prefilled(requests=[{"full": [0, 1], "swa": {"²": 3}}]), "a logical block is '²'; expected ASCII decimal digits"),
    (_prefilled(requests=[{"full": [0, 1], "swa": {"١": 3}}]), "a logical block is '١'; expected ASCII decimal digits"),
    (_prefilled(requests=[{"full": [0, 1], "swa": {"01": 3}}]), "a logical block is '01'; expected ASCII decimal"),
    (_prefilled(requests=[{"full": [0, 1], "swa": {"-1": 3}}]), "a logical block is '-1'; expected ASCII decimal"),
    (_prefilled(requests=[{"full": [0, 1], "swa": {"9" * 5000: 3}}]), "; expected ASCII decimal digits"),
    (_prefilled(requests=[{"full": [0, 1], "swa": {"2": 3}}]), "a logical block is 2; expected an integer in 0..1"),
    (_prefilled(requests=[{"full": "all", "swa": {}}]), "a request's block ids are"),
    (_prefilled(requests=[]), "is not one block list a prompt"),
    (_prefilled(round="0"), "round is '0'; expected an integer"),
    (_prefilled(computed="5"), "computed positions is '5'; expected an integer in 0..5"),
    (_prefilled(computed=5.0), "computed positions is 5.0; expected an integer in 0..5"),
    # less than the run asked for: nothing, or one position short of N-1
    (_prefilled(computed=0, requests=[{"full": [], "swa": {}}]),
     "the prefill computed 0 positions of prompts of 6 tokens; the run needs their first 5 (N-1); no decode step ran"),
    (_prefilled(computed=4, requests=[{"full": [0], "swa": {}}]), "the prefill computed 4 positions of prompts of 6"),
    (_prefilled(requests=[{"full": [0], "swa": {}}]),
     "request 0 hands over 1 full-attention blocks; its 5 computed positions fill 2 blocks of 4; no decode step ran"),
])
def test_a_hostile_prefill_reply_is_one_line(tmp_path, reply, message):
    with scripted(tmp_path, [_hello(), reply]) as (endpoint, _):
        peer = Peer(endpoint, timeout=5)
        peer.check(PLAN, FMT)
        with pytest.raises(GkError) as e:
            peer.prefill([[1, 2, 3, 4, 5, 6]])
        peer.close()
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_good_prefill_reply_is_taken(tmp_path):
    with scripted(tmp_path, [_hello(), _prefilled()]) as (endpoint, _):
        peer = Peer(endpoint, timeout=5)
        peer.check(PLAN, FMT)
        assert peer.prefill([[1, 2, 3, 4, 5, 6]]) == {"round": 0, "computed": 5,
                                                      "requests": [{"full": [0, 1], "swa": {1: 2}}]}
        peer.close()


TIMEOUT = 1.0


@pytest.mark.parametrize("answers,delay,phase", [
    ([], 0, "handshake"),  # accepts and never answers
    ([_hello()], 0.2, "handshake"),  # slow-loris: its hello a byte every 0.2 s, each byte in time for a per-recv timeout
    ([_hello()], 0, "prefill"),  # silent once it has said hello
    ([_hello(), _prefilled()], 0, "release"),  # silent after the transfer: never acknowledges the release
], ids=["silent", "slow-loris", "silent-prefill", "silent-release"])
def test_a_stalled_peer_is_one_line_at_the_deadline(tmp_path, answers, delay, phase):
    with scripted(tmp_path, answers, "--byte-delay", str(delay)) as (endpoint, log):
        t = time.monotonic()
        with pytest.raises(GkError) as e:
            peer = Peer(endpoint, timeout=TIMEOUT)
            peer.check(PLAN, FMT)
            peer.release(peer.prefill([[1, 2, 3, 4, 5, 6]])["round"])
        took = time.monotonic() - t
    assert str(e.value) == (f"prefill at {endpoint[0]}:{endpoint[1]}: the {phase} did not complete within 1 s "
                            f"(--transfer-timeout); no decode step ran")
    assert TIMEOUT <= took < TIMEOUT + MARGIN, took
    # the last frame the peer saw is the stalled phase's request (a "closed" may follow it: the
    # decode side hangs up at its deadline, before the fake is stopped)
    seen = [line for line in log.read_text().splitlines() if line.startswith("recv ")]
    assert seen[-1] == f"recv {phase if phase != 'handshake' else 'hello'}", seen
