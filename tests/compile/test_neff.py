import json

import pytest

from gkbuild.compile import neff
from gkbuild.errors import GkError
from tests.compile.neff_files import make
from tests.conftest import run_cli


def test_reads_the_documented_layout(tmp_path):
    p = tmp_path / "decode.neff"
    p.write_bytes(make(name="gk_decode", lnc=1, feature_bits=0x25))
    h = neff.read(p)
    assert (h.header_size, h.pkg_version, h.neff_version_major, h.neff_version_minor) == (1024, 1, 2, 0)
    assert h.name == "gk_decode" and h.lnc_size == 1 and h.feature_bits == 0x25
    assert h.build_version == "2.21.0.0+abcdef" and h.uuid == "0123456789abcdef0123456789abcdef"
    assert h.num_tpb == 1 and h.requested_tpb_count == 1 and h.tpb_per_node == [1]
    assert h.data_size == p.stat().st_size - 1024
    assert neff.decode(neff.encode(h)) == h  # the header round-trips


def test_md5_packaging(tmp_path):
    p = tmp_path / "x.neff"
    p.write_bytes(make(pkg_version=2))
    assert neff.read(p).pkg_version == 2


@pytest.mark.parametrize("damage, message", [
    (lambda b: b[:700], r"not a NEFF: 700 bytes, shorter than the 1024-byte header"),
    (lambda b: b[:-10], r"truncated or corrupt NEFF: the header promises \d+ payload bytes, the file has \d+"),
    (lambda b: b"PK\x03\x04" + b"\0" * 2000, r"not a NEFF \(header size 0, packaging version"),
    (lambda b: b[:8] + (2048).to_bytes(8, "little") + b[16:], r"not a NEFF \(header size 2048"),
    (lambda b: b[:1024] + b"x" + b[1025:], r"corrupt NEFF: the payload is not a gzip tarball"),
    (lambda b: b[:-1] + bytes([b[-1] ^ 1]), r"corrupt NEFF: the payload's sha256 does not match the header"),
])
def test_rejects_what_is_not_a_neff(tmp_path, damage, message):
    p = tmp_path / "bad.neff"
    p.write_bytes(damage(make()))
    with pytest.raises(GkError, match=message):
        neff.read(p)
    r = run_cli("inspect", str(p))
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1


def test_inspect_neff(tmp_path):
    p = tmp_path / "tail.neff"
    p.write_bytes(make(name="gk_tail"))
    r = run_cli("inspect", str(p), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["name"] == "gk_tail"
    r = run_cli("inspect", str(p))
    assert r.returncode == 0 and "lnc_size" in r.stdout
