"""Planning a farm: every program of every recipe (and ``--vary`` variant), named by its compile key.

Planning reads recipes and model configs only (a synth:// preset, a folder's or the hub's
config.json): no weights, no torch. Programs two recipes share (same key) are one job.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from pathlib import Path

from .. import recipe as rc
from ..errors import GkError, shown
from . import MAX_PLANS


@dataclass(frozen=True)
class Job:
    """One program to compile, with everything a worker needs to trace it: the recipe's text (and
    the overrides on it) and the model config the planner read."""

    key: str
    program: str  # decode, tail, decode-b8...
    batch: str  # the program's batch size, or the range one dynamic-batch program covers ("1..4")
    target: str
    recipes: tuple[str, ...]  # the recipes (and variants) whose builds use it
    recipe_text: str
    recipe_path: str  # names the recipe in errors; anchors its relative paths (a local kernel folder)
    overrides: tuple[str, ...]
    config: dict  # the model's config.json, as the planner read it
    cpus: int
    memory: int  # bytes
    expect: dict  # format, target, compiler and flags of the artifact (what the cache entry must say)

    def summary(self) -> dict:
        return {"key": self.key, "program": self.program, "batch_size": self.batch, "target": self.target,
                "recipes": list(self.recipes), "cpus": self.cpus, "memory_gib": round(self.memory / 2**30, 2)}


def variants(vary: list[str], recipes: int = 1) -> list[list[str]]:
    """``--vary KEY=[V1, V2]`` options as lists of ``--set`` assignments: their cross product,
    refused before it is formed when it and ``recipes`` make more than ``MAX_PLANS`` plans."""
    axes = []
    for item in vary:
        k, sep, values = item.partition("=")
        parsed = rc.parse_yaml(values, f"--vary {shown(item)}") if sep and k else None
        if not isinstance(parsed, list) or not parsed:
            raise GkError(f"--vary {shown(item)}: expected KEY=[V1, V2, ...] (a YAML list of values), "
                          f"e.g. 'decode.batch_sizes=[[1], [8]]'")
        axes.append([f"{k}={_yaml(v)}" for v in parsed])
    plans = recipes * math.prod(len(a) for a in axes)
    if plans > MAX_PLANS:
        sizes = " x ".join(str(n) for n in (recipes, *(len(a) for a in axes)))
        raise GkError(f"--vary: {sizes} (recipes x values of each --vary) is {plans} plans, over the limit of "
                      f"{MAX_PLANS}; split the farm into several runs")
    return [list(c) for c in itertools.product(*axes)]


def _yaml(v) -> str:
    import json

    return json.dumps(v)  # JSON is YAML: each value re-read exactly as it was given


def plan(recipe_paths: list[Path], overrides: list[str] = (), vary: list[str] = ()) -> list[Job]:
    """Every program of every recipe and variant, one job a compile key, in recipe order."""
    from ..checkpoint.source import model_config, parse
    from ..compile import signature, stage
    from ..model import GptOssConfig
    from ..plan import make_plan

    jobs: dict[str, Job] = {}
    extras = variants(list(vary), len(recipe_paths))
    for path in recipe_paths:
        path = Path(path)
        text = rc.read_text(path)
        for extra in extras:
            sets = [*overrides, *extra]
            r = rc.loads(text, path, sets)
            # the config as a build reads it back from config.json (and as a worker rebuilds it)
            config = model_config(parse(r.source, base=path.parent), offline_preset=True).to_hf()
            cfg = GptOssConfig.from_hf(config)
            r.check_against(cfg)
            p = make_plan(r, cfg)
            be = stage.backend(p)
            sigs = signature.programs(p)
            keys = stage.program_keys(p, be, sigs)
            label = " ".join([r.name, *extra])
            cpus, memory = r.job_resources
            for s in sigs:
                k = keys[s.key]
                if k in jobs:
                    jobs[k] = replace(jobs[k], recipes=(*jobs[k].recipes, label))
                    continue
                lo, hi = min(r.decode.batch_sizes), max(r.decode.batch_sizes)
                batch = str(s.batch) if r.backend == "neuron" else (str(lo) if lo == hi else f"{lo}..{hi}")
                jobs[k] = Job(k, s.key, batch, r.target, (label,), text, str(path), tuple(sets), config, cpus,
                              memory, be.expect(s.program))
    return list(jobs.values())


def select(jobs: list[Job], only: str) -> Job:
    """The job of compile key ``only`` (the full key, or a prefix of at least 12 hex digits)."""
    if len(only) < 12 or any(c not in "0123456789abcdef" for c in only):
        raise GkError(f"--only {shown(only)}: give a compile key (12 to 64 hex digits, as --list prints)")
    hits = [j for j in jobs if j.key.startswith(only)]
    if len(hits) != 1:
        what = "no program of these recipes has" if not hits else f"{len(hits)} programs have"
        raise GkError(f"--only {only}: {what} that compile key")
    return hits[0]


def missing(jobs: list[Job], cache) -> list[Job]:
    """The jobs whose program ``cache`` does not hold (and verify, as ``CompileCache.holds`` does)."""
    return [j for j in jobs if not cache.holds(j.key, j.program, j.expect)]
