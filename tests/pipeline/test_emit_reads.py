"""What a TP rank's attention shard reads of the checkpoint: only its heads' rows of q/k/v and the
sinks, and o_proj whole (one range a layer; its columns are strided: ``emit._attn``). Over the tp
ranks, every q/k/v/sinks byte is read once and o_proj tp times; before, every rank read q/k/v
whole, twice (once for W_qkv, once for bias_qkv)."""

from __future__ import annotations

from collections import Counter

from gkbuild import recipe
from gkbuild.checkpoint.reader import Checkpoint
from gkbuild.pipeline import emit
from gkbuild.plan import make_plan
from tests.conftest import RECIPES


class Counting(Checkpoint):
    """A checkpoint that counts the bytes of each tensor it is asked for (every read is one range)."""

    def __init__(self, ck: Checkpoint):
        super().__init__(ck.root, ck.config, ck.headers, ck.where, plain=True)
        self.read_bytes: Counter = Counter()

    def read(self, name, lo=None, hi=None):
        a = super().read(name, lo, hi)
        self.read_bytes[name] += a.nbytes
        return a


def test_each_tp_rank_reads_only_its_heads(topo_ckpt, tmp_path):
    r = recipe.load(RECIPES / "tiny-topology-trn3.yaml")
    ck = Counting(Checkpoint.open(topo_ckpt))
    plan = make_plan(r, ck.config)
    d = plan.dims
    assert d.kv >= d.tp  # no kv head replicated over ranks: each k/v row has one reader
    root = str(tmp_path / "src")
    emit.use_checkpoint(root, ck)
    try:
        ctx = emit.Context(root, str(tmp_path / "out"), d, r.experts, 1.0)
        for f in plan.files:
            if f.role == "attn":
                emit.run_shard(ctx, emit.ShardJob(f.role, f.index, f.path, f.tensors))
    finally:
        emit._ck.pop(root, None)
    assert d.tp == len([f for f in plan.files if f.role == "attn"]) == 8
    attn = {n: i.nbytes for n, i in ck.where.items() if ".self_attn." in n and "o_proj.bias" not in n}
    want = {n: b * (d.tp if n.endswith("o_proj.weight") else 1) for n, b in attn.items()}
    assert dict(ck.read_bytes) == want
