"""NEFF files built from the documented header layout, for the tests."""

import gzip
import hashlib
import io
import tarfile

from gkbuild.compile import neff


def make(name="decode", lnc=1, feature_bits=0x5, pkg_version=1, payload: bytes | None = None,
         major=2, minor=0) -> bytes:
    if payload is None:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            data = b"kernel instructions"
            info = tarfile.TarInfo("sg00/def.json")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        payload = gzip.compress(buf.getvalue(), mtime=0)
    algo = hashlib.new(neff.PACKAGING.get(pkg_version, "sha256"))
    algo.update(payload)
    h = neff.NeffHeader(pkg_version=pkg_version, header_size=1024, data_size=len(payload), neff_version_major=major,
                        neff_version_minor=minor, build_version="2.21.0.0+abcdef", num_tpb=1, hash=algo.hexdigest(),
                        uuid="0123456789abcdef0123456789abcdef", name=name, requested_tpb_count=1,
                        tpb_per_node=[1], feature_bits=feature_bits, lnc_size=lnc)
    return neff.encode(h) + payload
