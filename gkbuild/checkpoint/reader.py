"""Open an HF-layout GPT-OSS MXFP4 checkpoint: validate it fully from headers, then map tensors.

Nothing is loaded: ``read`` returns a zero-copy view into a memory-mapped file, and ``release``
drops a tensor's pages from the process once the caller is done with it, so reading a 65 GB
checkpoint tensor by tensor keeps memory flat.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .. import jsonio
from ..errors import GkError
from ..model import GptOssConfig
from . import names
from .safetensors_io import Header, MappedFile, TensorInfo, read_header

if TYPE_CHECKING:
    import numpy as np

# numpy is imported where tensors are read: a no-op build only lists the weight files.
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


@dataclass
class Checkpoint:
    root: Path
    config: GptOssConfig
    headers: dict[str, Header]  # file name -> header
    where: dict[str, TensorInfo]  # tensor name -> location
    extras: list[str] = field(default_factory=list)  # tensors present but not expected
    _maps: dict[str, MappedFile] = field(default_factory=dict, repr=False)
    _checked: set = field(default_factory=set, repr=False)  # (name, lo, hi) already checked
    plain: bool = False  # bf16 tensors read as their u16 bits (a build: no ml_dtypes import)
    layout: str = "mxfp4"  # how the experts are held (``names.LAYOUTS``), from the tensors

    # -- opening ------------------------------------------------------------------------------
    @classmethod
    def open(cls, root: Path | str, plain: bool = False) -> "Checkpoint":
        root = Path(root)
        if not root.is_dir():
            raise GkError(f"{root}: not a checkpoint folder")
        config = GptOssConfig.from_file(root / "config.json")
        files = weight_files(root)
        headers = {f: read_header(root / f) for f in files}
        return cls.assemble(root, config, headers, _read_index(root), plain)

    @classmethod
    def assemble(cls, root, config: GptOssConfig, headers: dict[str, Header], index: dict[str, str] | None,
                 plain: bool = False):
        """A checkpoint from its files' headers and its index (tensor -> file), all cross-checked
        against each other and the config; ``root`` names it in messages; ``plain``: see the field."""
        where: dict[str, TensorInfo] = {}
        for f, h in headers.items():
            for name, info in h.tensors.items():
                if name in where:
                    raise GkError(f"{root / f}: tensor {name} is also in {where[name].file.name}")
                where[name] = info
        if index is not None:
            for name, f in index.items():
                if name not in where:
                    raise GkError(f"{root / f}: tensor {name} is listed in {INDEX} but not in the file")
                if where[name].file.name != f:
                    raise GkError(f"{root / INDEX}: tensor {name} is listed in {f} but lives in "
                                  f"{where[name].file.name}")
        ck = cls(root, config, headers, where, plain=plain)
        ck._validate()
        return ck

    def _validate(self) -> None:
        self.layout = names.detect_layout({n: i.dtype.name for n, i in self.where.items()}, str(self.root))
        expected = names.expected_specs(self.config, self.layout)
        for spec in expected:
            info = self.where.get(spec.name)
            if info is None:
                raise GkError(f"{self.root}: missing tensor {spec.name} ({spec.dtype}{list(spec.shape)}) "
                              f"required by config.json")
            if info.shape != spec.shape or info.dtype.name != spec.dtype:
                raise GkError(f"{info.file}: tensor {spec.name} is {info.dtype.name}{list(info.shape)}, "
                              f"expected {spec.dtype}{list(spec.shape)}")
        known = {s.name for s in expected}
        self.extras = sorted(n for n in self.where if n not in known)
        self._check_config_layout()

    def _check_config_layout(self) -> None:
        """config.json's ``quantization_config`` (kept in ``config.extra``) says MXFP4 exactly when
        the experts are: transformers loads a checkpoint by its config and fails on the other layout."""
        declared = "quantization_config" in self.config.extra
        if declared == (self.layout == "mxfp4"):
            return
        first = next(n for n in sorted(self.where) if (names.dense_expert if declared else names.mx_expert)(n))
        if declared:
            raise GkError(f"{self.root / 'config.json'}: quantization_config says MXFP4 but tensor {first} is a "
                          f"dense {self.layout} expert weight; a dense checkpoint has no quantization_config")
        raise GkError(f"{self.root / 'config.json'}: no quantization_config (a dense checkpoint) but tensor {first} "
                      f"is MXFP4; the hub's MXFP4 config has quantization_config.quant_method 'mxfp4'")

    # -- reading ------------------------------------------------------------------------------
    def info(self, name: str) -> TensorInfo:
        try:
            return self.where[name]
        except KeyError:
            raise GkError(f"{self.root}: no tensor {name}") from None

    def _map(self, info: TensorInfo) -> MappedFile:
        key = info.file.name
        if key not in self._maps:
            self._maps[key] = MappedFile(self.headers[key], plain=self.plain)
        return self._maps[key]

    def read(self, name: str, lo: int | None = None, hi: int | None = None) -> np.ndarray:
        """A read-only zero-copy view of tensor ``name`` (or of its leading slice [lo, hi)).

        MXFP4 scales are checked as they are read (only the slice asked for, once): a 255 byte
        names the file and tensor.
        """
        info = self.info(name)
        m = self._map(info)
        arr = m.array(info)
        if lo is not None:
            arr = arr[lo:hi]
        m.populate(info.offset + (lo or 0) * self._row(info), arr.nbytes)
        return self._check(info, arr, lo, hi)

    def _check(self, info: TensorInfo, arr: np.ndarray, lo: int | None, hi: int | None) -> np.ndarray:
        """``arr`` (tensor ``info``'s slice [lo, hi)) once its values are checked (once a slice)."""
        name = info.name
        if (name, lo, hi) not in self._checked:  # the reference reads a layer's tensors once a pass
            from .mxfp4 import check_scales

            where = f"{info.file}: tensor {name}" + (f"[{lo}:{hi}]" if lo is not None else "")
            if name.endswith("_scales"):
                check_scales(arr, where)
            elif info.dtype.name in _EXPONENT:
                check_finite(arr, info.dtype.name, where)
            self._checked.add((name, lo, hi))
        return arr

    def prefetch(self, name: str, lo: int, hi: int) -> None:
        """Start reading tensor ``name``'s leading slice [lo, hi) from disk and return: a later
        ``read`` of it finds it in the page cache (or waits for it there)."""
        info = self.info(name)
        if not info.shape or not 0 <= lo <= hi <= info.shape[0]:
            raise ValueError(f"{name}: no leading slice [{lo}, {hi}) in {list(info.shape)}")
        row = self._row(info)
        self._map(info).prefetch(info.offset + lo * row, (hi - lo) * row)

    def release(self, name: str, lo: int | None = None, hi: int | None = None) -> None:
        """Drop tensor ``name``'s mapped pages (or those of its leading slice [lo, hi)) from this
        process's memory; they stay in the page cache."""
        info = self.info(name)
        if lo is None:
            self._map(info).release(info.offset, info.nbytes)
            return
        row = self._row(info)
        self._map(info).release(info.offset + lo * row, (hi - lo) * row)

    @staticmethod
    def _row(info: TensorInfo) -> int:
        """Bytes of one slice along the tensor's leading axis (a scalar: the whole tensor)."""
        return info.nbytes // max(info.shape[0], 1) if info.shape else info.nbytes

    def deep_check(self, advance=lambda n: None) -> None:
        """Read every byte once (file order, pages released as it goes): NaN scales, non-finite floats."""
        import numpy as np

        for info in sorted(self.where.values(), key=lambda i: (i.file.name, i.offset)):
            arr = self.read(info.name)
            if info.dtype.name in ("bf16", "fp16", "fp32"):
                rows = arr.reshape(arr.shape[0], -1) if arr.ndim > 1 else arr.reshape(1, -1)
                step = max(1, (64 << 20) // max(rows[0].nbytes, 1))
                for r in range(0, rows.shape[0], step):
                    if not np.isfinite(rows[r:r + step].astype(np.float32)).all():
                        raise GkError(f"{info.file}: tensor {info.name} has non-finite values")
            self.release(info.name)
            advance(info.nbytes)

    def close(self) -> None:
        for m in self._maps.values():
            m.close()
        self._maps.clear()

    # -- facts ----------------------------------------------------------------------------------
    def bytes_by_kind(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for name, info in self.where.items():
            k = names.kind(name)
            out[k] = out.get(k, 0) + info.nbytes
        return out


MAX_INDEX = 64 << 20  # the 120b index is ~100 KB


# A float's exponent bits, all ones for NaN and infinity: (bits as, mask), by dtype name.
_EXPONENT = {"bf16": ("uint16", 0x7F80), "fp32": ("uint32", 0x7F800000)}


def check_finite(arr: np.ndarray, dtype: str, where: str) -> None:
    """A NaN or infinity (exponent bits all ones) in a bf16 or fp32 tensor means a corrupt or
    diverged checkpoint: refused where it is read, so a build never carries one into its shards.
    Checked in 8 MiB pieces: the temporary stays small whatever the tensor."""
    import numpy as np

    view, mask = _EXPONENT[dtype]
    bits = np.asarray(arr).view(view).reshape(-1)
    step = (8 << 20) // bits.itemsize
    for start in range(0, bits.size, step):
        exp = np.bitwise_and(bits[start:start + step], mask)
        if exp.max() == mask:
            bad = np.flatnonzero(exp == mask)
            raise GkError(f"{where}: non-finite {dtype} value(s) (NaN or infinity), first at flat index "
                          f"{start + int(bad[0])}")


def _read_index(root: Path) -> dict[str, str] | None:
    p = root / INDEX
    if not p.exists():
        return None
    if not p.is_file():
        raise GkError(f"{p}: not a safetensors index (a folder)")
    return read_index(p, str(p))


def read_index(p: Path, where: str) -> dict[str, str]:
    """A safetensors index's weight map (tensor -> file), bounded and checked."""
    return weight_map(jsonio.read(p, MAX_INDEX, where), where)


def weight_map(obj, where: str) -> dict[str, str]:
    """The ``weight_map`` of a parsed safetensors index, checked."""
    wm = obj.get("weight_map") if isinstance(obj, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        raise GkError(f"{where}: not a valid safetensors index (needs a 'weight_map' object of file names)")
    return wm


def weight_files(root: Path) -> list[str]:
    index = _read_index(root)
    if index is not None:
        files = sorted(set(index.values()))
        for f in files:
            if Path(f).name != f or f.startswith("."):
                raise GkError(f"{root / INDEX}: weight file {f!r} is not a plain file name")
            if not (root / f).exists():
                raise GkError(f"{root / f}: listed in {INDEX} but missing")
        return files
    if (root / SINGLE).exists():
        return [SINGLE]
    raise GkError(f"{root}: no {INDEX} and no {SINGLE}")
