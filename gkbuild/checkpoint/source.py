"""Where a build's checkpoint comes from: ``hf://org/name@rev``, ``s3://bucket/prefix``, a local
folder, or ``synth://PRESET``.

``synth://PRESET?layers=N&seed=S`` is synthesized once into the gkbuild cache (``$GKBUILD_CACHE``,
default ``~/.cache/gkbuild``) and reused: synthesis is deterministic for a seed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qsl, urlparse

from ..errors import GkError
from ..model import GptOssConfig, preset
from ..paths import file_lock
from ..progress import Advance

SYNTH_KEYS = ("layers", "seed")
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

    def describe(self) -> dict:
        d = {"kind": self.kind, "uri": self.uri}
        if self.kind == "synth":
            d.update(preset=self.preset, layers=self.layers, seed=self.seed)
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
        cfg.with_layers(layers)  # range check
        return SourceSpec("synth", f"synth://{name}?layers={layers}&seed={seed}", name, layers, seed)
    if text.startswith("s3://"):
        from ..s3 import parse as parse_s3

        return SourceSpec("s3", parse_s3(text).uri)
    if "://" in text:
        raise GkError(f"{key}: unknown source scheme in {text!r}; use hf://, s3://, synth:// or a folder path")
    p = Path(text).expanduser()
    if not p.is_absolute() and base is not None:
        p = base / p
    return SourceSpec("dir", text, path=str(p.resolve()))


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


def synth_cache_dir(spec: SourceSpec) -> Path:
    """Where a synth:// source lives once synthesized (keyed by everything its bytes depend on)."""
    from .synth import SYNTH_VERSION

    return cache_root() / "synth" / f"{spec.preset}-L{spec.layers}-s{spec.seed}-v{SYNTH_VERSION}"


def materialize(spec: SourceSpec, advance: Advance = lambda n: None) -> Path:
    """The local checkpoint folder for a source (downloading or synthesizing as needed)."""
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
    from .synth import synthesize

    out = synth_cache_dir(spec)
    if (out / "config.json").exists():
        return out
    # Builds sharing a cache synthesize one at a time; the one that waited finds it done. A
    # finished checkpoint is never replaced; a folder left without config.json (not one synthesis
    # writes: it renames a complete folder into place) is refused rather than deleted.
    with file_lock(out.with_name(out.name + ".lock")):
        if not (out / "config.json").exists():
            synthesize(synth_config(spec), out, seed=spec.seed, advance=advance)
    return out
