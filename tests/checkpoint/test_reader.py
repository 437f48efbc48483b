"""The reader accepts real-layout checkpoints and rejects each kind of damage with one clear line."""

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from gkbuild.checkpoint import names
from gkbuild.checkpoint.reader import INDEX, Checkpoint
from gkbuild.errors import GkError
from tests.conftest import run_cli

L0 = names.layer_prefix(0)
SCALES = L0 + "mlp.experts.gate_up_proj_scales"


def _file_of(ck_dir: Path, tensor: str) -> Path:
    return ck_dir / json.loads((ck_dir / INDEX).read_text())["weight_map"][tensor]


def _rewrite_header(path: Path, mutate) -> None:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    mutate(header)
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])


def _resave(ck_dir: Path, tensor: str, replace) -> None:
    """Rewrite the file holding ``tensor`` with the official safetensors writer, ``replace``-ing it."""
    f = _file_of(ck_dir, tensor)
    ck = Checkpoint.open(ck_dir)
    tensors = {}
    for name, info in ck.where.items():
        if info.file == f:
            a = ck.read(name) if not name.endswith("_scales") else ck._map(info).array(info)
            tensors[name] = torch.from_numpy(np.array(a).view(np.uint16 if a.dtype.itemsize == 2 else a.dtype))
            if str(a.dtype) == "bfloat16":
                tensors[name] = tensors[name].view(torch.bfloat16)
    ck.close()
    new = replace(tensors[tensor])
    if new is None:
        del tensors[tensor]
    else:
        tensors[tensor] = new
    save_file(tensors, str(f))


def test_reads_a_multi_file_checkpoint(tiny_ckpt):
    ck = Checkpoint.open(tiny_ckpt)
    assert len(ck.headers) > 1
    assert ck.extras == []
    emb = ck.read(names.EMBED)
    assert emb.shape == (ck.config.V, ck.config.H) and str(emb.dtype) == "bfloat16"
    assert not emb.flags.writeable  # a view of the read-only mapping, not a copy
    ck.release(names.EMBED)
    assert np.isfinite(emb.astype(np.float32)).all()  # pages come back on demand after release


def test_prefetch_takes_a_leading_slice_and_refuses_one_outside_the_tensor(tiny_ckpt):
    """The reference reads experts ahead by index: an index off the tensor is a bug, never a read elsewhere."""
    ck = Checkpoint.open(tiny_ckpt)
    E = ck.info(SCALES).shape[0]
    ck.prefetch(SCALES, 0, E)
    ck.prefetch(SCALES, E - 1, E)
    for lo, hi in ((-1, 1), (0, E + 1), (2, 1)):
        with pytest.raises(ValueError, match="no leading slice"):
            ck.prefetch(SCALES, lo, hi)
    with pytest.raises(ValueError, match="no leading slice"):
        ck.prefetch(names.FINAL_NORM, 0, 1 << 40)
    ck.close()


def test_reads_files_written_by_the_official_safetensors_writer(tiny_copy):
    _resave(tiny_copy, SCALES, lambda t: t)
    ck = Checkpoint.open(tiny_copy)
    assert ck.read(SCALES).shape[0] == ck.config.E


def test_single_file_checkpoint(tiny_copy):
    ck = Checkpoint.open(tiny_copy)
    tensors = {}
    for name in ck.where:
        a = np.array(ck.read(name))
        t = torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16) if str(a.dtype) == "bfloat16" \
            else torch.from_numpy(a)
        tensors[name] = t
    ck.close()
    for f in tiny_copy.glob("model-*.safetensors"):
        f.unlink()
    (tiny_copy / INDEX).unlink()
    save_file(tensors, str(tiny_copy / "model.safetensors"))
    assert len(Checkpoint.open(tiny_copy).headers) == 1


@pytest.mark.parametrize("damage, message", [
    ("truncate", r"truncated: tensor .* ends at data byte"),
    ("offsets", r"header offsets .* hold .* bytes but"),
    ("overlap", r"overlaps the previous tensor"),
    ("json", r"corrupt safetensors header: not valid JSON"),
    ("header_len", r"header length .* exceeds"),
    ("missing", r"missing tensor model\.layers\.0\.mlp\.router\.bias"),
    ("stale_index", r"router\.bias is listed in model\.safetensors\.index\.json but not in the file"),
    ("shape", r"tensor model\.layers\.0\.mlp\.router\.bias is bf16\[7\], expected bf16\[8\]"),
    ("dtype", r"tensor model\.layers\.0\.mlp\.router\.bias is fp32\[8\], expected bf16\[8\]"),
    ("index_file", r"listed in model\.safetensors\.index\.json but missing"),
    ("no_config", r"no config\.json"),
    ("bad_config", r"quantization_config\.quant_method must be 'mxfp4'"),
])
def test_malformed_checkpoints_are_rejected(tiny_copy, damage, message):
    bias = L0 + "mlp.router.bias"
    f = _file_of(tiny_copy, bias)
    if damage == "truncate":
        with open(f, "r+b") as fh:
            fh.truncate(f.stat().st_size - 1000)
    elif damage == "offsets":
        _rewrite_header(f, lambda h: h[bias]["data_offsets"].__setitem__(1, h[bias]["data_offsets"][1] + 2))
    elif damage == "overlap":
        def shift(h):
            first = min((v for k, v in h.items() if k != "__metadata__"), key=lambda v: v["data_offsets"][0])
            second = min((v for k, v in h.items() if k != "__metadata__" and v is not first),
                         key=lambda v: v["data_offsets"][0])
            b, e = second["data_offsets"]
            second["data_offsets"] = [b - 2, e - 2]
        _rewrite_header(f, shift)
    elif damage == "json":
        raw = bytearray(f.read_bytes())
        raw[8] = ord("#")
        f.write_bytes(bytes(raw))
    elif damage == "header_len":
        raw = bytearray(f.read_bytes())
        raw[:8] = struct.pack("<Q", 1 << 40)
        f.write_bytes(bytes(raw))
    elif damage in ("missing", "stale_index"):
        _resave(tiny_copy, bias, lambda t: None)
        if damage == "missing":
            index = json.loads((tiny_copy / INDEX).read_text())
            del index["weight_map"][bias]
            (tiny_copy / INDEX).write_text(json.dumps(index))
    elif damage == "shape":
        _resave(tiny_copy, bias, lambda t: t[:7].clone())
    elif damage == "dtype":
        _resave(tiny_copy, bias, lambda t: t.float())
    elif damage == "index_file":
        f.unlink()
    elif damage == "no_config":
        (tiny_copy / "config.json").unlink()
    elif damage == "bad_config":
        cfg = json.loads((tiny_copy / "config.json").read_text())
        cfg["quantization_config"]["quant_method"] = "fp8"
        (tiny_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(GkError, match=message):
        Checkpoint.open(tiny_copy)
    # the CLI: one line, naming the problem, non-zero exit
    r = run_cli("inspect", str(tiny_copy))
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gkbuild: error: "), r.stderr
    assert "Traceback" not in r.stderr


def test_nan_scale_is_named_when_read(tiny_copy):
    f = _file_of(tiny_copy, SCALES)
    info = Checkpoint.open(tiny_copy).info(SCALES)
    with open(f, "r+b") as fh:
        fh.seek(info.offset + 12345)
        fh.write(b"\xff")
    ck = Checkpoint.open(tiny_copy)  # headers are fine
    ck.read(SCALES, 1, 2)  # another expert's slice is clean
    with pytest.raises(GkError, match=rf"{f.name}: tensor {SCALES}.*255 \(NaN in E8M0\)"):
        ck.read(SCALES)
    r = run_cli("inspect", "--deep", str(tiny_copy))
    assert r.returncode == 1 and "255 (NaN in E8M0)" in r.stderr and f.name in r.stderr


def _disk_reads() -> int:
    """Bytes this process has read from the block device (``/proc/self/io``)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="no /proc/self/io: this kernel does not count a "
                    "process's block reads")
def test_a_slice_read_from_disk_costs_its_bytes_not_the_readahead_window_around_it(tmp_path):
    """The reference reads one expert (a row of a stacked tensor) at a time from checkpoints larger
    than the page cache. A fault on a page that is not cached reads the device's readahead window
    around it (8 MiB on the project's hosts: ~4x a 120b expert's bytes); ``read`` asks for the exact
    range first (issue 28). Hosts with a small readahead window pass either way."""
    rows = np.random.default_rng(0).integers(0, 256, (32, 256 << 10), dtype=np.uint8)  # 32 rows of 256 KiB
    save_file({"w": torch.from_numpy(rows)}, str(tmp_path / "model.safetensors"))
    from gkbuild.checkpoint.safetensors_io import MappedFile, read_header

    h = read_header(tmp_path / "model.safetensors")
    fd = os.open(h.path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # out of the page cache: the next read is the disk's
    finally:
        os.close(fd)
    m = MappedFile(h)
    info, row = h.tensors["w"], rows.shape[1]
    before = _disk_reads()
    m.populate(info.offset + 16 * row, row)
    read = _disk_reads() - before
    if read == 0:
        pytest.skip("the file's pages stayed cached (tmpfs, or eviction refused): no disk read to measure")
    assert read <= row + (64 << 10), f"{read} bytes read from disk for a {row}-byte slice"
    np.testing.assert_array_equal(m.array(info)[16], rows[16])
    m.close()
