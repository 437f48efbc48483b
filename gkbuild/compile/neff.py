"""The NEFF header: 1024 bytes before the payload (a gzip tarball).

Field offsets up to ``tpb_per_node`` follow the published layout of Amazon's KLR NEFF writer
(little-endian): packaging version (1: tgz + sha256, 2: tgz + md5), header size (1024), payload
size, NEFF major/minor, a 128-byte build string, the TPB count, the payload hash (hex, 64 bytes),
a 32-byte uuid, a 256-byte name, the requested TPB count and 64 bytes of TPBs per node. The later
fields CONTRACT.md lists (feature bits, LNC size) sit in what that writer leaves as padding, at the
offsets below: an assumption to check against a NEFF from the pinned compiler.
"""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import GkError
from ..jsonio import open_regular

HEADER_SIZE = 1024
_FMT = "<QQQQQ128sI64s32s256sI64sQI"  # ... tpb_per_node (to 592), feature_bits, lnc_size
_PAD = HEADER_SIZE - struct.calcsize(_FMT)
PACKAGING = {1: "sha256", 2: "md5"}


@dataclass(frozen=True)
class NeffHeader:
    pkg_version: int
    header_size: int
    data_size: int
    neff_version_major: int
    neff_version_minor: int
    build_version: str
    num_tpb: int
    hash: str
    uuid: str
    name: str
    requested_tpb_count: int
    tpb_per_node: list[int]
    feature_bits: int
    lnc_size: int

    def to_dict(self) -> dict:
        return asdict(self)


def _text(b: bytes) -> str:
    return b.split(b"\0", 1)[0].decode("ascii", errors="replace")


def encode(h: NeffHeader) -> bytes:
    """The 1024 header bytes of ``h`` (the inverse of :func:`decode`)."""
    tpn = bytes(h.tpb_per_node) + b"\0" * (64 - len(h.tpb_per_node))
    raw = struct.pack(_FMT, h.pkg_version, h.header_size, h.data_size, h.neff_version_major, h.neff_version_minor,
                      h.build_version.encode(), h.num_tpb, h.hash.encode(), h.uuid.encode(), h.name.encode(),
                      h.requested_tpb_count, tpn, h.feature_bits, h.lnc_size)
    return raw + b"\0" * _PAD


def decode(raw: bytes) -> NeffHeader:
    f = struct.unpack_from(_FMT, raw)
    return NeffHeader(pkg_version=f[0], header_size=f[1], data_size=f[2], neff_version_major=f[3],
                      neff_version_minor=f[4], build_version=_text(f[5]), num_tpb=f[6], hash=_text(f[7]),
                      uuid=_text(f[8]), name=_text(f[9]), requested_tpb_count=f[10],
                      tpb_per_node=[b for b in f[11] if b], feature_bits=f[12], lnc_size=f[13])


def read(path: Path, check_payload: bool = True) -> NeffHeader:
    """Read and check a NEFF's header (and its payload's size, format and hash)."""
    path = Path(path)
    try:
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            raw = f.read(HEADER_SIZE)
            magic = f.read(2)
    except FileNotFoundError:
        raise GkError(f"{path}: file not found") from None
    if size < HEADER_SIZE:
        raise GkError(f"{path}: not a NEFF: {size} bytes, shorter than the {HEADER_SIZE}-byte header")
    h = decode(raw)
    if h.header_size != HEADER_SIZE or h.pkg_version not in PACKAGING:
        raise GkError(f"{path}: not a NEFF (header size {h.header_size}, packaging version {h.pkg_version})")
    if h.data_size != size - HEADER_SIZE:
        raise GkError(f"{path}: truncated or corrupt NEFF: the header promises {h.data_size} payload bytes, "
                      f"the file has {size - HEADER_SIZE}")
    if check_payload:
        if magic != b"\x1f\x8b":
            raise GkError(f"{path}: corrupt NEFF: the payload is not a gzip tarball")
        algo = hashlib.new(PACKAGING[h.pkg_version])
        with open_regular(path) as f:
            f.seek(HEADER_SIZE)
            while chunk := f.read(8 << 20):
                algo.update(chunk)
        if h.hash and algo.hexdigest() != h.hash:
            raise GkError(f"{path}: corrupt NEFF: the payload's {PACKAGING[h.pkg_version]} does not match the header")
    return h
