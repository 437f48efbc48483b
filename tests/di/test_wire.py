"""The DI side channel is data from another process: every hostile answer is one line, before
anything is allocated from it or a descriptor is built."""

import json
import socket
import struct
import threading

import pytest

from gkbuild.di import plan as di
from gkbuild.di.decode import Peer
from gkbuild.errors import GkError
from gkbuild.reference import KvFormat
from tests.conftest import RECIPES


def _plan() -> dict:
    from gkbuild import recipe
    from gkbuild.model import preset
    from gkbuild.pipeline.pipeline import layout_docs
    from gkbuild.plan import make_plan

    p = make_plan(recipe.load(RECIPES / "tiny-topology-trn2.yaml"), preset("tiny-topology"))
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


def _frame(obj) -> bytes:
    return _frame_raw(json.dumps(obj).encode())


def _frame_raw(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


def _serve(answers: list[bytes]):
    """A side channel that sends ``answers``, one after each message it receives."""
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(1)

    def run():
        conn, _ = ls.accept()
        with conn:
            for a in answers:
                n = struct.unpack(">I", conn.recv(4))[0]
                while n:
                    n -= len(conn.recv(n))
                conn.sendall(a)
        ls.close()

    threading.Thread(target=run, daemon=True).start()
    return ls.getsockname()


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
def test_a_hostile_hello_is_one_line(answer, message):
    with pytest.raises(GkError) as e:
        Peer(_serve([answer]))
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
def test_an_engine_that_is_not_the_plans_is_refused(engine, ranks, message):
    peer = Peer(_serve([_frame({"op": "hello", "version": 1, "engine": engine, "ranks": ranks})]))
    with pytest.raises(GkError) as e:
        peer.check(PLAN, FMT)
    assert message in str(e.value) and "\n" not in str(e.value)
    peer.close()


@pytest.mark.parametrize("requests,message", [
    ([{"full": [0, 99], "swa": {}}], "a block id is 99; expected an integer in 0..15"),
    ([{"full": [0], "swa": {"x": 1}}], "a logical block is None"),
    ([{"full": "all", "swa": {}}], "a request's block ids are"),
    ([], "is not one block list a prompt"),
])
def test_hostile_block_ids_are_refused(requests, message):
    reply = _frame({"op": "prefilled", "round": 0, "computed": 5, "requests": requests})
    peer = Peer(_serve([_hello(), reply]))
    peer.check(PLAN, FMT)
    with pytest.raises(GkError) as e:
        peer.prefill([[1, 2, 3, 4, 5, 6]])
    assert message in str(e.value)
    peer.close()
