"""Where a build's checkpoint comes from: ``hf://org/name@rev``, ``s3://bucket/prefix``, a local
folder, or ``synth://PRESET``.

``synth://PRESET?layers=N&seed=S`` names the checkpoint ``gkbuild synth PRESET --layers N --seed S``
writes (deterministic for a seed); ``&dtype=bf16`` (or ``fp32``) the dense one ``--dtype bf16`` writes
(``dtype=mxfp4`` is the default and is left out of the normalized URI, so an MXFP4 source's URI,
cache folder and build ids are what they were before dense synthesis existed). It is read one of two ways, the same bytes either way (so the
same build id), chosen by ``$GKBUILD_SYNTH_READ``:
- ``auto`` (the default): the copy synthesized into the gkbuild cache (``$GKBUILD_CACHE``, default
  ``~/.cache/gkbuild``) when there is one; else synthesized there once and memory-mapped when it
  is at most ``SYNTH_DISK_MAX`` (16 GiB: every test preset, the 120b up to 8 layers), else read by
  range and never written (``synth_ranged``: the 36-layer 120b, 61 GB, on a small disk);
- ``range``: by range, whatever its size (the cached copy is not used);
- ``disk``: synthesized into the cache, whatever its size.
``synth_by_range`` says which. Read by range, it is a source like ``s3://`` and ``hf://`` for
``checkpoint.ranged`` (``ranged.connect``): the streamed build, the build and the golden read it so.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qsl, urlparse

from ..errors import GkError
from ..model import GptOssConfig, preset
from ..paths import file_lock, resolved
from ..progress import Advance

SYNTH_KEYS = ("layers", "seed", "dtype")
SYNTH_DTYPES = ("mxfp4", "bf16", "fp32")  # synth.DTYPES (not imported: synth is numpy's)
SYNTH_READ = "GKBUILD_SYNTH_READ"  # auto | range | disk (the module's docstring)
SYNTH_DISK_MAX = 16 << 30
# Hub repos whose config a preset reproduces: planning can proceed offline from the preset.
KNOWN_REPOS = {"openai/gpt-oss-120b": "gpt-oss-120b", "openai/gpt-oss-20b": "gpt-oss-20b"}


@dataclass(frozen=True)
class SourceSpec:
    kind: str  # "hf" | "s3" | "dir" | "synth"
    uri: str  # as written in the recipe (hf/s3/synth normalized): a build never records a machine path
    preset: str | None = None
    layers: int | None = None
    seed: int = 0
    path: str | None = None  # dir: the resolved folder
    dtype: str = "mxfp4"  # synth: the layout it writes (``SYNTH_DTYPES``)

    def describe(self) -> dict:
        d = {"kind": self.kind, "uri": self.uri}
        if self.kind == "synth":
            d.update(preset=self.preset, layers=self.layers, seed=self.seed)
            if self.dtype != "mxfp4":
                d.update(dtype=self.dtype)
        return d


def parse(text: str, base: Path | None = None, key: str = "source") -> SourceSpec:
    if not isinstance(text, str) or not text:
        raise GkError(f"{key}: expected hf://ORG/NAME@REV, s3://BUCKET/PREFIX, synth://PRESET?layers=N&seed=S or a folder")
    if text.startswith("hf://"):
        from .hub import parse as parse_hf

        ref = parse_hf(text)
        return SourceSpec("hf", ref.uri)
    if text.startswith("synth://"):
        u = urlparse(text)
        name = u.netloc + u.path
        cfg = preset(name)
        q = dict(parse_qsl(u.query, keep_blank_values=True))
        unknown = sorted(set(q) - set(SYNTH_KEYS))
        if unknown:
            raise GkError(f"{key}: unknown synth parameter(s) {unknown}; known: {', '.join(SYNTH_KEYS)}")
        try:
            layers = int(q.get("layers", cfg.L))
            seed = int(q.get("seed", 0))
        except ValueError:
            raise GkError(f"{key}: synth layers and seed must be integers in {text!r}") from None
        if not 0 <= seed < 2 ** 63:
            raise GkError(f"{key}: synth seed must be in 0..2^63-1 in {text!r}")
        dtype = q.get("dtype", "mxfp4")
        if dtype not in SYNTH_DTYPES:
            raise GkError(f"{key}: synth dtype must be one of {', '.join(SYNTH_DTYPES)}, got {dtype!r} in {text!r}")
        cfg.with_layers(layers)  # range check
        uri = f"synth://{name}?layers={layers}&seed={seed}" + (f"&dtype={dtype}" if dtype != "mxfp4" else "")
        return SourceSpec("synth", uri, name, layers, seed, dtype=dtype)
    if text.startswith("s3://"):
        from ..s3 import parse as parse_s3

        return SourceSpec("s3", parse_s3(text).uri)
    if "://" in text:
        raise GkError(f"{key}: unknown source scheme in {text!r}; use hf://, s3://, synth:// or a folder path")
    p = Path(text).expanduser()
    if not p.is_absolute() and base is not None:
        p = base / p
    return SourceSpec("dir", text, path=str(resolved(p, key)))


def cache_root() -> Path:
    return Path(os.environ.get("GKBUILD_CACHE", Path.home() / ".cache" / "gkbuild"))


def synth_config(spec: SourceSpec) -> GptOssConfig:
    return preset(spec.preset).with_layers(spec.layers)


def model_config(spec: SourceSpec, offline_preset: bool = False) -> GptOssConfig:
    """The model config without reading any weights (hub: config.json only).

    With ``offline_preset``, a known openai repo whose config cannot be fetched falls back to the
    matching preset, with a warning (planning needs shapes, not weights).
    """
    if spec.kind == "synth":
        return synth_config(spec)
    if spec.kind == "dir":
        return GptOssConfig.from_file(Path(spec.path) / "config.json")
    if spec.kind == "s3":
        from .s3_source import fetch_config as s3_config

        return GptOssConfig.from_file(s3_config(spec.uri))
    from .hub import fetch_config, parse as parse_hf

    try:
        return GptOssConfig.from_file(fetch_config(spec.uri))
    except GkError as e:
        name = KNOWN_REPOS.get(parse_hf(spec.uri).repo)
        if not (offline_preset and name):
            raise
        from ..progress import warn

        warn(f"{e}; planning with the built-in {name} config instead")
        return preset(name)


SYNTH_VERSION = 2  # bump when synth's generated bytes change (2: a tokenizer beside the weights)


def synth_cache_dir(spec: SourceSpec) -> Path:
    """Where a synth:// source lives once synthesized (keyed by everything its bytes depend on;
    not importing synth, which is numpy's: a cached build needs only this name)."""
    dense = f"-{spec.dtype}" if spec.dtype != "mxfp4" else ""  # an MXFP4 source's folder is as it was
    return cache_root() / "synth" / f"{spec.preset}-L{spec.layers}-s{spec.seed}{dense}-v{SYNTH_VERSION}"


def synth_by_range(spec: SourceSpec) -> bool:
    """Whether a synth:// source is read by range rather than from disk (the module's docstring)."""
    if spec.kind != "synth":
        return False
    mode = os.environ.get(SYNTH_READ, "auto") or "auto"
    if mode not in ("auto", "range", "disk"):
        raise GkError(f"{SYNTH_READ}={mode!r}: expected auto, range or disk")
    if mode != "auto":
        return mode == "range"
    if (synth_cache_dir(spec) / "config.json").exists():
        return False
    from . import names

    return sum(s.nbytes for s in names.expected_specs(synth_config(spec), spec.dtype)) > SYNTH_DISK_MAX


def open_source(spec: SourceSpec, advance: Advance = lambda n: None, ranged: bool = False):
    """What a reader of the whole checkpoint (the golden) opens: a ``checkpoint.ranged.Remote``
    for a source read by range (``synth_by_range``; with ``ranged``, hf:// and s3:// too: no
    mirror on local disk), else the local folder (``materialize``)."""
    if synth_by_range(spec) or (ranged and spec.kind in ("hf", "s3")):
        from .ranged import connect

        return connect(spec.uri)
    return materialize(spec, advance)


def materialize(spec: SourceSpec, advance: Advance = lambda n: None) -> Path:
    """The local checkpoint folder for a source (downloading or synthesizing as needed). A synth
    source read by range (``synth_by_range``) is never written: refused."""
    if spec.kind == "dir":
        p = Path(spec.path)
        if not p.is_dir():
            raise GkError(f"source {p}: folder not found")
        return p
    if spec.kind == "hf":
        from .hub import resolve

        return resolve(spec.uri)[1]
    if spec.kind == "s3":
        from .s3_source import resolve as resolve_s3

        return resolve_s3(spec.uri, advance)
    out = synth_cache_dir(spec)
    if synth_by_range(spec):
        raise GkError(f"source {spec.uri}: read by range, never written here; this needs it on disk "
                      f"({SYNTH_READ}=disk synthesizes it into {cache_root()})")
    if (out / "config.json").exists():
        return out
    from .synth import synthesize

    # Builds sharing a cache synthesize one at a time; the one that waited finds it done. A
    # finished checkpoint is never replaced; a folder left without config.json (not one synthesis
    # writes: it renames a complete folder into place) is refused rather than deleted.
    with file_lock(out.with_name(out.name + ".lock")):
        if not (out / "config.json").exists():
            synthesize(synth_config(spec), out, seed=spec.seed, advance=advance, dtype=spec.dtype)
    return out
