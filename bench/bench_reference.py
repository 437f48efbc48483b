"""Golden + verify of a gpt-oss-120b-shaped trn2 build at full width (issue 18): for each layer
count, `gkbuild synth gpt-oss-120b --layers N`, `gkbuild golden` of it (4 prompts x 32 positions:
4 prompt tokens + 28 greedy steps, FP8 e4m3 KV as trn2 stores it), the build from
`recipes/gpt-oss-120b-trn3.yaml --set target=trn2` (TP8 x DP16 x EP128, `--no-compile`), and `gkbuild verify` of it
against that golden. Wall and CPU seconds (user + system) and peak RSS of each command, the load
average around it (the machine is shared), and a least-squares line through the layer counts
projected to the 36-layer model. Run alone: one 120b-width process at a time. Disk: a checkpoint
and its build of the largest N at once (~33 GB at 8 layers); each is removed when done.
`--resume` keeps what an interrupted run (e.g. a full disk) measured and made in ``--dir``.

`--base TREE` (issue 28): also run the golden and the verify of another gkbuild tree (e.g. `git archive`
of the commit before a change, without a venv: run with this venv's packages), alternating which goes
first at each layer count, on the same checkpoint and build; each tree's verify is held to its own
golden, and the two goldens are compared. `--golden-only`: the goldens alone (`--repeat` of them, alternating,
the least CPU kept), no build or verify. `--golden-once`: the verifies alone, both held to one golden made by
this tree (for a change that leaves the golden's code alone).

    .venv/bin/python bench/bench_reference.py [--layers 2 4 8] [--dir /tmp/gkbench-ref] [--resume] [--base TREE]
                                              [--repeat N] [--golden-only | --golden-once]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _measure import dir_arg, gib, run, run_cpu, scratch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GK = str(Path(sys.executable).with_name("gkbuild"))
MODEL_LAYERS = 36


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through the points."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - slope * mx, slope


def base_command(tree: Path) -> tuple[list[str], dict]:
    """How to run another tree's gkbuild with this venv's packages: ``-S`` keeps this venv's
    editable install of the working tree off the path, PYTHONPATH puts the tree first."""
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{sysconfig.get_paths()['purelib']}"}
    return [sys.executable, "-S", "-m", "gkbuild"], env


def compare_trees(a: argparse.Namespace) -> None:
    """Golden + verify of the working tree ("new") and ``--base`` ("base") at each layer count, one
    after the other in alternating order, on one checkpoint and one build (made by the new tree)."""
    with scratch(a.dir) as d:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        base_gk, base_env = base_command(Path(a.base).resolve())
        trees = {"base": (base_gk, base_env), "new": ([GK], dict(os.environ))}
        T = a.prompt_len + a.steps
        print(f"{a.prompts} prompts x {T} positions, FP8 e4m3 KV; {os.cpu_count()} cores; base {a.base}")
        print("| tree | run | layers | wall | CPU | peak RSS | load before / after |")
        print("|---|---|---|---|---|---|---|")
        got: dict = {}
        for n, L in enumerate(a.layers):
            order = ["base", "new"] if n % 2 == 0 else ["new", "base"]
            ck, out = d / f"ck{L}", d / f"build{L}"
            run([GK, "synth", "gpt-oss-120b", "--layers", str(L), "--out", str(ck), "-q"])
            for tree in ["new"] if a.golden_once else order * (a.repeat if a.golden_only else 1):
                cmd, env = trees[tree]
                m = run_cpu(cmd + ["golden", str(ck), "--out", str(d / f"golden-{tree}{L}.safetensors"), "--prompts",
                                   str(a.prompts), "--prompt-len", str(a.prompt_len), "--steps", str(a.steps), "--kv",
                                   "fp8_e4m3", "-q"], stderr=subprocess.DEVNULL, env=env, cwd=d)
                if (tree, "golden", L) not in got or m["cpu"] < got[tree, "golden", L]["cpu"]:
                    got[tree, "golden", L] = m  # of repeats, the one with the least CPU
                print(f"| {tree} | golden | {L} | {m['wall']:.1f} s | {m['cpu']:.1f} s | {gib(m['rss'])} | "
                      f"{m['load'][0]:.1f} / {m['load'][1]:.1f} |", flush=True)
            if not a.golden_only:
                verify_trees(a, trees, order, ck, out, L, got)
            if not a.golden_once:
                compare_goldens(d, L)
            shutil.rmtree(ck, ignore_errors=True)
            shutil.rmtree(out, ignore_errors=True)
        if len(a.layers) < 2:
            return
        kinds = ("golden",) if a.golden_only else ("verify",) if a.golden_once else ("golden", "verify")
        print(f"\nLinear fit over {a.layers} layers, projected to {MODEL_LAYERS} ({' + '.join(kinds)}):")
        total = {}
        for tree in ("base", "new"):
            for what in ("wall", "cpu"):
                total[tree, what] = 0.0
                for kind in kinds:
                    c, sl = fit(a.layers, [got[tree, kind, L][what] for L in a.layers])
                    total[tree, what] += c + sl * MODEL_LAYERS
                    print(f"- {tree} {kind} {what}: {c:.1f} s + {sl:.1f} s a layer -> "
                          f"{(c + sl * MODEL_LAYERS) / 60:.1f} min")
            print(f"- {tree}: {' + '.join(kinds)} at {MODEL_LAYERS} layers: wall {total[tree, 'wall'] / 60:.1f} min, "
                  f"CPU {total[tree, 'cpu'] / 60:.1f} min; peak RSS "
                  + ", ".join(f"{k} {L} layers {gib(got[tree, k, L]['rss'])}" for k in kinds for L in a.layers))
        print(f"- new / base: wall {total['new', 'wall'] / total['base', 'wall']:.2f}x, "
              f"CPU {total['new', 'cpu'] / total['base', 'cpu']:.2f}x")


def verify_trees(a: argparse.Namespace, trees: dict, order: list[str], ck: Path, out: Path, L: int, got: dict) -> None:
    """The build of checkpoint ``ck`` (by the new tree) into ``out``, then each tree's verify of it against
    its own golden, ``a.repeat`` times in ``order`` (the least CPU kept in ``got``)."""
    d = out.parent
    run([GK, "compile", str(ROOT / "recipes" / "gpt-oss-120b-trn3.yaml"), "--set", "target=trn2", "--set", f"source={ck}",
         "--out", str(out), "--no-compile", "-q"], stdout=subprocess.DEVNULL)
    if a.golden_once:
        shutil.rmtree(ck, ignore_errors=True)  # verify reads the build and the golden only
    # untimed: the first verify of a build hashes its files (later ones find them in the fingerprint
    # cache), which would fall on whichever tree goes first
    run([GK, "verify", str(out), "--golden", str(d / f"golden-new{L}.safetensors"), "-q"],
        stdout=subprocess.DEVNULL)
    for tree in order * a.repeat:
        cmd, env = trees[tree]
        golden = d / f"golden-{'new' if a.golden_once else tree}{L}.safetensors"
        with open(d / f"verify-{tree}{L}.json", "w") as f:
            m = run_cpu(cmd + ["verify", str(out), "--golden", str(golden), "--json", "-q"], stdout=f, env=env, cwd=d)
        if (tree, "verify", L) not in got or m["cpu"] < got[tree, "verify", L]["cpu"]:
            got[tree, "verify", L] = m  # of repeats, the one with the least CPU
        rep = json.loads((d / f"verify-{tree}{L}.json").read_text())
        print(f"| {tree} | verify | {L} | {m['wall']:.1f} s | {m['cpu']:.1f} s | {gib(m['rss'])} | "
              f"{m['load'][0]:.1f} / {m['load'][1]:.1f} |", flush=True)
        print(f"|  | verify {L} layers ({tree}): ok={rep['ok']}, max err {rep['max_abs_err']:.4f}, worst expert "
              f"{max(rep['experts']['worst_by_layer']):.1e} of {rep['experts']['checked']}, tail "
              f"{rep['tail']['norm_error']:.1e} / {rep['tail']['lm_head_error']:.1e}, local error (worst) "
              f"{max(rep['layer_local_errors']):.1e} | | | | | |", flush=True)
        if "stages" in rep:
            print("|  | stages: " + ", ".join(f"{k} {v['wall']:.1f} s ({v['cpu']:.1f} s CPU)"
                                              for k, v in rep["stages"].items()) + " | | | | | |", flush=True)


def compare_goldens(d: Path, L: int) -> None:
    """The two trees' goldens at ``L`` layers: their tokens, and their largest difference."""
    from safetensors.torch import load_file

    gb, gn = (load_file(str(d / f"golden-{t}{L}.safetensors")) for t in ("base", "new"))
    diff = {k: float((gb[k].double() - gn[k].double()).abs().max()) for k in gb}
    print(f"|  | goldens at {L} layers: tokens equal {bool((gb['token_ids'] == gn['token_ids']).all())}, largest "
          f"difference {max(diff.values()):.1e} ({max(diff, key=diff.get)}) | | | | | |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8])
    dir_arg(ap, "/tmp/gkbench-ref")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=4)
    ap.add_argument("--steps", type=int, default=28)
    ap.add_argument("--resume", action="store_true", help="keep the measurements and files already in --dir")
    ap.add_argument("--base", help="another gkbuild tree to run beside this one, alternating (issue 28)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="with --base: verify pairs a layer count (the least CPU kept); golden pairs with --golden-only")
    how = ap.add_mutually_exclusive_group()
    how.add_argument("--golden-only", action="store_true", help="with --base: time the goldens only (no build, no verify)")
    how.add_argument("--golden-once", action="store_true",
                     help="with --base: one golden a layer count, by this tree (a change that leaves the golden's "
                          "code alone), both trees' verifies held to it")
    a = ap.parse_args()
    if a.base:
        return compare_trees(a)
    with scratch(a.dir, resume=a.resume) as d:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        T = a.prompt_len + a.steps
        print(f"{a.prompts} prompts x {T} positions ({a.prompt_len} prompt tokens + {a.steps} greedy), FP8 e4m3 KV; "
              f"{os.cpu_count()} cores")
        print("| run | layers | wall | CPU | wall per layer-position | CPU per layer-position | peak RSS | load before/after |")
        print("|---|---|---|---|---|---|---|---|")
        rows = {"golden": {}, "verify": {}}
        for L in a.layers:
            ck, g, out = d / f"ck{L}", d / f"golden{L}.safetensors", d / f"build{L}"
            measured = {kind: d / f"measured-{kind}{L}.json" for kind in rows}
            if not measured["golden"].exists():
                if not (ck / "config.json").exists():
                    shutil.rmtree(ck, ignore_errors=True)
                    run([GK, "synth", "gpt-oss-120b", "--layers", str(L), "--out", str(ck), "-q"])
                m = run_cpu([GK, "golden", str(ck), "--out", str(g), "--prompts", str(a.prompts), "--prompt-len",
                             str(a.prompt_len), "--steps", str(a.steps), "--kv", "fp8_e4m3", "-q"], stderr=subprocess.DEVNULL)
                measured["golden"].write_text(json.dumps(m))
            if not measured["verify"].exists():
                if not (out / "manifest.json").exists():
                    shutil.rmtree(out, ignore_errors=True)
                    run([GK, "compile", str(ROOT / "recipes" / "gpt-oss-120b-trn3.yaml"), "--set", "target=trn2", "--set", f"source={ck}",
         "--out", str(out), "--no-compile", "-q"], stdout=subprocess.DEVNULL)
                shutil.rmtree(ck, ignore_errors=True)
                with open(d / f"verify{L}.json", "w") as f:
                    m = run_cpu([GK, "verify", str(out), "--golden", str(g), "--json", "-q"], stdout=f)
                measured["verify"].write_text(json.dumps(m))
            shutil.rmtree(ck, ignore_errors=True)
            shutil.rmtree(out, ignore_errors=True)
            for kind in rows:
                rows[kind][L] = json.loads(measured[kind].read_text())
            for kind in rows:
                m = rows[kind][L]
                print(f"| {kind} | {L} | {m['wall']:.1f} s | {m['cpu']:.1f} s | {m['wall'] / (L * T):.3f} s | "
                      f"{m['cpu'] / (L * T):.3f} s | {gib(m['rss'])} | {m['load'][0]:.1f} / {m['load'][1]:.1f} |", flush=True)
            rep = json.loads((d / f"verify{L}.json").read_text())
            local = ", ".join(f"{w:.1e} / {m:.1e}" for w, m in zip(rep["layer_local_errors"], rep["layer_local_median"]))
            print(f"|  | verify {L} layers: ok={rep['ok']}, max err {rep['max_abs_err']:.4f}, forced {rep['routing_forced']} "
                  f"of {rep['routing_total']}, local error by layer (worst / median) {local}, worst expert "
                  f"{max(rep['experts']['worst_by_layer']):.1e}, tail {rep['tail']['norm_error']:.1e} / "
                  f"{rep['tail']['lm_head_error']:.1e} | | | | | | |", flush=True)
        if len(a.layers) > 1:
            print(f"\nLinear fit over {a.layers} layers, projected to {MODEL_LAYERS}:")
            total = {"wall": 0.0, "cpu": 0.0}
            for kind, by in rows.items():
                xs = sorted(by)
                for what in ("wall", "cpu"):
                    c, s = fit(xs, [by[L][what] for L in xs])
                    total[what] += c + s * MODEL_LAYERS
                    print(f"- {kind} {what}: {c:.1f} s + {s:.1f} s a layer -> {c + s * MODEL_LAYERS:.0f} s "
                          f"({(c + s * MODEL_LAYERS) / 60:.1f} min)")
                peaks = ", ".join(f"{L} layers {gib(by[L]['rss'])}" for L in xs)
                print(f"- {kind} peak RSS: {peaks}")
            print(f"- golden + verify at {MODEL_LAYERS} layers: wall {total['wall'] / 60:.1f} min, CPU {total['cpu'] / 60:.1f} min")


if __name__ == "__main__":
    main()
