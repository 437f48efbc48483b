"""Checkpoints read by byte range (``compile --to``): through the hub's file system (a stand-in with
huggingface_hub's signatures) and S3 (moto), every tensor and slice equals the memory-mapped read
of the same files, each read fetches exactly its bytes (a rank group's rows at once when asked),
reads stay pinned to what was listed, and an LFS file's sha256 comes from the listing unread."""

import hashlib

import boto3
import numpy as np
import pytest
from huggingface_hub import CommitOperationAdd

from gkbuild.checkpoint.ranged import RangedCheckpoint, Remote
from gkbuild.checkpoint.reader import Checkpoint
from gkbuild.errors import GkError
from tests.publish.fake_hub import FakeHub


@pytest.fixture
def hub(tiny_ckpt):
    h = FakeHub()
    h.create_repo("org/ck")
    ops = [CommitOperationAdd(path_in_repo=p.name, path_or_fileobj=str(p)) for p in sorted(tiny_ckpt.iterdir())]
    ops.append(CommitOperationAdd(path_in_repo="big.bin", path_or_fileobj=bytes(range(256)) * (48 << 10)))  # 12 MiB: LFS
    h.create_commit("org/ck", ops, commit_message="upload")
    return h


def test_every_tensor_and_slice_read_by_range_equals_the_mapped_read(hub, tiny_ckpt):
    ck = RangedCheckpoint.open_remote(Remote("hf://org/ck@main", api=hub, fs=hub))
    local = Checkpoint.open(tiny_ckpt)
    assert ck.config == local.config and sorted(ck.where) == sorted(local.where)
    for name, info in ck.where.items():
        before = ck.fetched
        assert np.array_equal(ck.read(name), local.read(name)), name
        assert ck.fetched - before in (0, info.nbytes)  # exactly its bytes (or none: memoized)
        if info.shape and info.shape[0] > 2:
            ck._memo.clear()
            before = ck.fetched
            assert np.array_equal(ck.read(name, 1, 3), local.read(name, 1, 3))
            assert ck.fetched - before == 2 * info.nbytes // info.shape[0]


def test_a_rank_group_fetches_its_rows_of_a_tensor_once(hub, tiny_ckpt, monkeypatch):
    from gkbuild.checkpoint import ranged

    ck = RangedCheckpoint.open_remote(Remote("hf://org/ck@main", api=hub, fs=hub))
    local = Checkpoint.open(tiny_ckpt)
    name = "model.layers.0.mlp.experts.gate_up_proj_blocks"
    row = ck.info(name).nbytes // ck.info(name).shape[0]
    monkeypatch.setattr(ranged, "WINDOW", 4 * row)  # the group's rows are a window
    gets, real = [], ck.remote.read
    ck.remote.read = lambda f, start, n: (gets.append((start, n)), real(f, start, n))[1]
    for e in range(2, 6):  # experts 2..5, a group of four shards of one expert each
        ck.group = (2, 6, e)
        assert np.array_equal(ck.read(name, e, e + 1), local.read(name, e, e + 1))
    assert gets == [(ck.info(name).offset + 2 * row, 4 * row)]  # one GET of the group's rows, each expert cut from it


def test_reads_stay_on_the_listed_commit_and_an_lfs_sha256_is_not_read(hub, tiny_ckpt):
    remote = Remote("hf://org/ck@main", api=hub, fs=hub)
    ck = RangedCheckpoint.open_remote(remote)
    name = "model.norm.weight"
    old = ck.read(name).copy()
    f = ck.info(name).file.name
    data = bytearray((tiny_ckpt / f).read_bytes())
    off = ck.info(name).offset
    data[off:off + 2] = b"\x00\x00"
    hub.create_commit("org/ck", [CommitOperationAdd(path_in_repo=f, path_or_fileobj=bytes(data))],
                      commit_message="a new revision")
    ck._memo.clear()
    assert np.array_equal(ck.read(name), old)  # still the commit the build listed
    reads = len(hub.reads)
    assert remote.sha256("big.bin") == hashlib.sha256(bytes(range(256)) * (48 << 10)).hexdigest()
    assert len(hub.reads) == reads  # from the listing's lfs entry
    assert remote.sha256("config.json") == hashlib.sha256((tiny_ckpt / "config.json").read_bytes()).hexdigest()


def test_an_s3_object_replaced_after_the_listing_is_refused(tiny_ckpt, bucket, s3_server):
    client = boto3.client("s3", endpoint_url=s3_server)
    for p in sorted(tiny_ckpt.iterdir()):
        client.upload_file(str(p), bucket, f"ck/{p.name}")
    remote = Remote(f"s3://{bucket}/ck")
    ck = RangedCheckpoint.open_remote(remote)
    name = "model.norm.weight"
    local = Checkpoint.open(tiny_ckpt)
    assert np.array_equal(ck.read(name), local.read(name))
    other = next(p.name for p in sorted(tiny_ckpt.glob("*.safetensors")) if p.name != ck.info(name).file.name)
    client.put_object(Bucket=bucket, Key=f"ck/{other}", Body=b"x" + (tiny_ckpt / other).read_bytes()[1:])
    victim = next(n for n, i in ck.where.items() if i.file.name == other)
    with pytest.raises(GkError, match="changed since the build listed it"):
        ck.read(victim)


def test_a_group_reads_every_byte_once_however_many_layers_its_shards_read(hub, tiny_ckpt, monkeypatch):
    """A job's shards run one after another, each reading its own rows of every layer's experts: the
    group's windows must outlive a whole shard's reads. With a memo that holds the windows of all the
    layers but not the shards' own rows too (at 120b scale: ~10 MB of windows against 446 MB of a
    shard's own blocks over 36 layers), every byte is fetched once: own rows are never memoized."""
    from gkbuild.checkpoint import ranged

    ck = RangedCheckpoint.open_remote(Remote("hf://org/ck@main", api=hub, fs=hub))
    local = Checkpoint.open(tiny_ckpt)
    experts = sorted(n for n in ck.where if ".mlp.experts." in n)
    E = ck.info(experts[0]).shape[0]
    group = {n: ck.info(n).nbytes for n in experts}  # a group of all E shards: its rows are the whole tensor
    small = {n: b for n, b in group.items() if not n.endswith("_blocks")}
    assert max(small.values()) < min(b for n, b in group.items() if n.endswith("_blocks"))
    monkeypatch.setattr(ranged, "WINDOW", max(small.values()))  # the small tensors windowed, the blocks not
    monkeypatch.setattr(ranged, "MEMO_BYTES", sum(small.values()) + 1)  # every window, and no more
    for e in range(E):
        ck.group = (0, E, e)
        for n in experts:
            assert np.array_equal(ck.read(n, e, e + 1), local.read(n, e, e + 1)), (n, e)
    assert ck.fetched == sum(group.values())
