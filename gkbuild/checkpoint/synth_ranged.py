"""A ``synth://PRESET?layers=N&seed=S[&dtype=bf16|fp32]`` checkpoint read by byte range and never written.

``SynthRemote`` is a ``ranged.Remote`` over the files ``gkbuild synth`` would write (config.json,
model.safetensors.index.json, each model-0000k-of-0000n.safetensors), every byte equal to them:
the metadata comes from the functions ``synthesize`` writes with, each weight file's header from
``layout_header`` (what its writer lays out), and its data from ``synth.pieces``, which generates
any element range of a tensor from the chunks it touches alone. So a range costs its own bytes
(plus at most a chunk of a norm or sink) and nothing is held beyond it: ``RangedCheckpoint``
reads it as it reads S3 or the hub (the streamed build, the golden, the build).

The tokenizer files synthesis writes beside the weights are not among these files: a text prompt
gets the same tokenizer from ``text.tokenizer`` without the weights.
"""

from __future__ import annotations

import bisect
import contextlib
import math
from dataclasses import dataclass

import numpy as np

from ..errors import GkError
from ..model import GptOssConfig
from . import synth
from .ranged import Remote, RemoteFile
from .reader import INDEX
from .safetensors_io import TensorSpec, layout_header
from .source import SYNTH_VERSION, parse, synth_config

TAG = f"gkbuild-synth-v{SYNTH_VERSION}"  # what a file's bytes depend on beyond the URI


@dataclass(frozen=True)
class _WeightFile:
    header: bytes
    starts: list[int]  # each tensor's first byte in the file, ascending
    specs: list[TensorSpec]  # in file order

    @property
    def size(self) -> int:
        return self.starts[-1] + self.specs[-1].nbytes if self.specs else len(self.header)


class SynthRemote(Remote):
    """The files of ``synth://PRESET?layers=N&seed=S`` (``uri``), generated as they are read."""

    kind = "synth"

    def __init__(self, uri: str, pin: dict | None = None):
        spec = parse(uri, key="synth source")
        if spec.kind != "synth":
            raise GkError(f"synth source: {uri!r} is not a synth:// URI")
        self.uri, self.pin, self.seed, self.dtype = spec.uri, dict(pin or {}), spec.seed, spec.dtype
        if self.pin.setdefault("synth", TAG) != TAG:
            raise GkError(f"source {self.uri}: synthesized by {self.pin['synth']}, this gkbuild makes {TAG}")
        self.cfg: GptOssConfig = synth_config(spec)
        self.read_bytes = 0
        weights = synth.weight_files(self.cfg, dtype=self.dtype)
        self._meta = {"config.json": synth.config_bytes(self.cfg, self.seed, self.dtype),
                      INDEX: synth.index_bytes(weights)}
        self._weights = {}
        for name, group in weights.items():
            header, rel = layout_header(group)
            order = sorted(group, key=lambda s: rel[s.name])
            self._weights[name] = _WeightFile(header, [len(header) + rel[s.name] for s in order], order)
        sizes = {**{n: len(b) for n, b in self._meta.items()}, **{n: w.size for n, w in self._weights.items()}}
        self._files = {n: RemoteFile(n, size, TAG, None) for n, size in sizes.items()}

    def errors(self):
        return contextlib.nullcontext()

    def files(self) -> dict[str, RemoteFile]:
        return self._files

    def read(self, name: str, start: int, n: int) -> bytearray:
        """Exactly bytes [start, start + n) of ``name``, generated."""
        size = self.file(name).size
        if start < 0 or n < 0 or start + n > size:
            raise GkError(f"source {self.uri}/{name}: no bytes [{start}, {start + n}) in its {size}")
        self.read_bytes += n
        if name in self._meta:
            return bytearray(self._meta[name][start:start + n])
        w = self._weights[name]
        out = bytearray(n)
        buf = np.frombuffer(out, dtype=np.uint8) if n else np.empty(0, np.uint8)
        end = start + n
        head = min(end, len(w.header))
        if start < head:
            buf[:head - start] = np.frombuffer(w.header, np.uint8, head - start, start)
        k = max(0, bisect.bisect_right(w.starts, start) - 1)
        while k < len(w.specs) and w.starts[k] < end:
            self._tensor_bytes(w.specs[k], max(start, w.starts[k]) - w.starts[k],
                               min(end, w.starts[k] + w.specs[k].nbytes) - w.starts[k],
                               buf[max(start, w.starts[k]) - start:])
            k += 1
        return out

    def _tensor_bytes(self, spec: TensorSpec, a: int, b: int, out: np.ndarray) -> None:
        """Bytes [a, b) of tensor ``spec``'s data into ``out`` (from its element range, cut to the bytes)."""
        if b <= a:
            return
        size = spec.nbytes // math.prod(spec.shape)
        first = a // size
        skip, pos = a - first * size, 0
        for piece in synth.pieces(self.cfg, spec, self.seed, first, -(-b // size) - first):
            raw = piece.reshape(-1).view(np.uint8)[skip:]
            take = min(raw.size, b - a - pos)
            out[pos:pos + take] = raw[:take]
            pos += take
            skip = 0

    def close(self) -> None:
        """Nothing is open."""
