"""The ``gkbuild`` command line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from . import __version__, cli_help
from .errors import GkError, printable, shown
from .farm import MAX_PLANS
from .progress import bar, note
from .recipe import SCALE_RULES
from .publish.codec import LEVEL as ZSTD_LEVEL
from .publish.leases import SKEW, TTL
from .units import parse_size

out = Console()
if not out.is_terminal:  # piped or captured: tables keep their columns instead of wrapping at 80
    out = Console(width=160)


def _cell(text) -> str:
    """A table cell of text a file, a store or a peer supplied: shown as it is (no rich markup, no
    control characters obeyed)."""
    return escape(printable(str(text)))


@click.group(cls=cli_help.Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="gkbuild")
def cli():
    """Build, verify and publish GPT-OSS giga-kernel (fused decode) artifacts from an MXFP4 checkpoint.

    Examples:
      gkbuild synth tiny --out ckpt          # a checkpoint in the exact hub layout
      gkbuild inspect ckpt                   # what is in it
      gkbuild plan recipes/tiny-cpu.yaml     # what a recipe builds, before reading weights
      gkbuild compile recipes/tiny-cpu.yaml  # build it into artifacts/tiny-cpu
      gkbuild check artifacts/tiny-cpu       # every byte against the manifest
      gkbuild verify artifacts/tiny-cpu --prompt "The capital of France is" --chat
      gkbuild publish artifacts/tiny-cpu --to STORE
      gkbuild fetch STORE --to DIR
    """


@cli.command()
@click.argument("preset")
@click.option("--out", "out_dir", required=True, type=click.Path(path_type=Path), help="Folder to write.")
@click.option("--layers", type=int, default=None, help="Keep only the first N layers (default: all).")
@click.option("--seed", type=int, default=0, show_default=True, help="Weights are a pure function of the seed.")
@click.option("--dtype", type=click.Choice(["mxfp4", "bf16", "fp32"]), default="mxfp4", show_default=True,
              help="mxfp4: the hub's layout; bf16 / fp32: a dense fine-tune as transformers saves one.")
@click.option("--max-shard-size", default="4GB", show_default=True, help="Split weight files at this size.")
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
def synth(preset, out_dir, layers, seed, dtype, max_shard_size, force, quiet):
    """Write a synthetic checkpoint of PRESET in the exact hub MXFP4 layout (or a dense one).

    PRESET is one of gpt-oss-120b, gpt-oss-20b, tiny, tiny-topology. The files (config.json,
    model.safetensors.index.json, model-0000k-of-0000n.safetensors) load in transformers like the
    real checkpoint. Writing streams: memory stays flat whatever the size.

    --dtype bf16 (or fp32) writes transformers' dense layout, as a fine-tune dequantized for
    training is saved (mlp.experts.gate_up_proj / down_proj, no quantization_config): every tensor
    but the experts equals the MXFP4 synth of the same seed; the experts hold values no MXFP4 grid
    does (with all-zero blocks, outliers and subnormals), for `gkbuild quantize` and builds from
    bf16 sources to chew on.

    Examples:
      gkbuild synth tiny --out ckpt
      gkbuild synth gpt-oss-120b --out ckpt-120b --layers 2 --seed 1
      gkbuild synth tiny --out ckpt-bf16 --dtype bf16
    """
    from .checkpoint.synth import synthesize, total_bytes
    from .model import preset as get_preset

    cfg = get_preset(preset)
    if layers is not None:
        cfg = cfg.with_layers(layers)
    with bar(f"synth {preset}", total_bytes(cfg, dtype), quiet) as advance:
        synthesize(cfg, out_dir, seed=seed, max_shard_bytes=parse_size(max_shard_size, "--max-shard-size"), force=force,
                   advance=advance, dtype=dtype)
    note(f"wrote {out_dir} ({preset}, {cfg.L} layers, seed {seed}, {dtype})", quiet)


@cli.command()
@click.argument("src", metavar="SRC")
@click.option("--out", "out_dir", required=True, type=click.Path(path_type=Path), help="Folder to write.")
@click.option("--scale-rule", type=click.Choice(SCALE_RULES), default="round_up", show_default=True,
              help="round_up: triton_kernels' downcast_to_mxfp (what transformers' MXFP4 integration calls); "
                   "floor: OCP MX v1.0 (torchao's to_mx FLOOR).")
@click.option("--max-shard-size", default="4GB", show_default=True, help="Split weight files at this size.")
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
def quantize(src, out_dir, scale_rule, max_shard_size, force, quiet):
    """Write a dense (bf16/fp32) checkpoint as an MXFP4 one in the exact hub layout.

    SRC is a dense checkpoint as transformers saves a fine-tune (mlp.experts.gate_up_proj /
    down_proj, no quantization_config): a folder, hf://ORG/NAME@REV, s3://BUCKET/PREFIX (read by
    range) or synth://PRESET?dtype=bf16. OUT gets the tensors, files and config.json of the hub's
    MXFP4 checkpoint (what `gkbuild synth` writes): the experts quantized by --scale-rule one expert
    at a time, every other tensor in bf16 (fp32 rounded to nearest even), the tokenizer files the
    source has. A build of OUT reads the same bytes as a build of SRC with that quantize.scale_rule.
    Streams (memory flat); OUT appears only when complete. An MXFP4 source is refused.

    Examples:
      gkbuild quantize ckpt-bf16 --out ckpt-mxfp4
      gkbuild quantize synth://tiny?dtype=bf16 --out ckpt-mxfp4 --scale-rule floor
    """
    from .checkpoint.ranged import RangedCheckpoint
    from .checkpoint.reader import Checkpoint
    from .checkpoint.source import open_source, parse
    from .checkpoint.synth import refuse_existing
    from .checkpoint.to_mxfp4 import quantize_checkpoint, refuse_mxfp4, total_bytes
    from .text import folder

    spec = parse(src, base=Path.cwd())
    refuse_existing(out_dir, force)  # before a source is fetched or synthesized
    shard = parse_size(max_shard_size, "--max-shard-size")
    root = open_source(spec, ranged=True)
    if isinstance(root, Path):
        from .pipeline.pipeline import refuse_overlap

        refuse_overlap(out_dir, root)
        ck = Checkpoint.open(root, plain=True)
    else:
        ck = RangedCheckpoint.open_remote(root, plain=True)
    try:
        refuse_mxfp4(ck)  # before the tokenizer is fetched
        tokenizer = folder(spec)
        with bar(f"quantize {spec.uri}", total_bytes(ck), quiet) as advance:
            quantize_checkpoint(ck, out_dir, scale_rule, tokenizer, shard, force, advance)
    finally:
        ck.close()
    note(f"wrote {out_dir} (MXFP4, scale rule {scale_rule}, from {ck.layout} {spec.uri})", quiet)


@cli.command()
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
@click.option("--deep", is_flag=True, help="Checkpoints: also read every tensor (NaN scales, non-finite weights).")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
def inspect(path, as_json, deep, quiet):
    """Summarize a build folder, a NEFF file or a checkpoint folder.

    Summarize PATH: a build folder (manifest.json), a NEFF file (its header), or a checkpoint
    folder (headers only, unless --deep).

    Examples:
      gkbuild inspect artifacts/tiny-cpu
      gkbuild inspect ckpt --deep --json
      gkbuild inspect artifacts/gpt-oss-120b-trn3/compiled/decode-b128.neff
    """
    from .checkpoint.reader import Checkpoint
    from .summary import build_tables, checkpoint_summary, checkpoint_table

    if not path.exists():
        raise GkError(f"{path}: no such file or folder")
    if path.is_file():
        from .compile import neff

        h = neff.read(path).to_dict()
        if as_json:
            click.echo(json.dumps(h, indent=2))
        else:
            t = Table(title=f"NEFF {path}", show_header=False, title_justify="left")
            t.add_column(style="bold")
            t.add_column()
            for k, v in h.items():
                t.add_row(k, str(v))
            out.print(t)
        return
    if (path / "manifest.json").exists():
        from .pipeline.check import summary

        _show(summary(path), build_tables, as_json)
        return
    ck = Checkpoint.open(path)
    if deep:
        with bar("reading", sum(i.nbytes for i in ck.where.values()), quiet or as_json) as advance:
            ck.deep_check(advance)
    _show(checkpoint_summary(ck), checkpoint_table, as_json)


def _show(s: dict, tables, as_json: bool) -> None:
    """A summary as JSON, or as the tables ``tables(s)`` makes."""
    if as_json:
        click.echo(json.dumps(s, indent=2))
    else:
        for t in tables(s):
            out.print(t)


def _set_option(f):
    return click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
                        help="Override a recipe key, e.g. --set kv_cache.dtype=bf16 (repeatable).")(f)


def _load_plan(recipe_path: Path, overrides, offline_preset: bool = False):
    from .checkpoint.source import model_config, parse
    from .plan import make_plan
    from .recipe import load

    r = load(recipe_path, overrides)
    spec = parse(r.source, base=recipe_path.parent)
    return make_plan(r, model_config(spec, offline_preset)), spec


@cli.command()
@click.argument("recipe_path", metavar="RECIPE", type=click.Path(path_type=Path))
@_set_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
@click.option("--show-compile", is_flag=True, help="Also print the exact compile invocations of the compile stage.")
def plan(recipe_path, overrides, as_json, show_compile):
    """Show what a recipe builds, and the compiler rules' verdict, reading no weights.

    Show what RECIPE builds, reading no weights: every file kind with its tensors, shapes,
    dtypes and bytes, how many ranks share each file, bytes per rank and on disk, the KV budget
    and the DMA offset check. The model config comes from the source's config.json (hf:// fetches
    only that file) or the preset (synth://).

    Examples:
      gkbuild plan recipes/gpt-oss-120b-trn3.yaml
      gkbuild plan recipes/tiny-cpu.yaml --set 'decode.batch_sizes=[1, 2]' --show-compile
    """
    from .summary import plan_tables

    p, _ = _load_plan(recipe_path, overrides, offline_preset=True)
    verdicts = []
    if p.recipe.backend == "neuron":
        from .compile import rules

        from .compile import hostprofile

        verdicts = rules.plan_verdicts(p, hostprofile.answers(hostprofile.of(p.recipe)))
        why = rules.refusal(verdicts)
        if why:
            raise GkError(f"{recipe_path}: {why}")
    compile_lines = []
    if show_compile:
        from .compile.stage import invocations

        compile_lines = invocations(p, p.recipe.output_dir())
    if as_json:
        j = p.to_json()
        if show_compile:
            j["compile"] = compile_lines
        if verdicts:
            j["verdicts"] = [v.to_dict() for v in verdicts]
        click.echo(json.dumps(j, indent=2))
        return
    for t in plan_tables(p):
        out.print(t)
    for v in verdicts:
        click.echo(f"verdict {v.program}: {v.short()}")
    for line in compile_lines:
        click.echo(line)


_sign_option = click.option(
    "--sign", "sign", metavar="KEY|sigstore", default=None,
    help="Sign the manifest and a provenance statement with model-signing: a private key's PEM file, or 'sigstore' "
         "for keyless signing with the CI's OIDC identity (needs gkbuild[sign]). compile: with --to only.")


@cli.command("compile")
@click.argument("recipe_path", metavar="RECIPE", type=click.Path(path_type=Path))
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default=None,
              help="Build folder (default: the recipe's output, artifacts/<name>).")
@click.option("--jobs", "-j", type=int, default=None, help="Parallel worker processes (default: one more than the cores).")
@click.option("--force", is_flag=True, help="Rebuild every stage, ignoring the cache.")
@click.option("--no-compile", is_flag=True, help="Stop before tracing/compiling: shards, metadata and manifest only.")
@click.option("--require-neff", is_flag=True, help="Fail (rather than warn) when a trn target's NEFFs cannot be "
                                                   "compiled because the Neuron SDK is missing.")
@click.option("--cache", "cache", metavar="STORE", envvar="GKBUILD_COMPILE_CACHE", default=None,
              help="A shared compile cache (folder, hf://ORG/NAME, s3://BUCKET/PREFIX) looked up before compiling "
                   "each program; env GKBUILD_COMPILE_CACHE.")
@click.option("--host-profile", "host_profile", metavar="DOCTOR.json", type=click.Path(path_type=Path), default=None,
              help="Follow a `gkbuild doctor` report's answers (Neuron targets; recipe key compile.host_profile).")
@click.option("--cache-push", is_flag=True, envvar="GKBUILD_COMPILE_CACHE_PUSH",
              help="Store the compiled programs in the --cache store; env GKBUILD_COMPILE_CACHE_PUSH=1.")
@click.option("--to", "to", metavar="STORE", default=None,
              help="Stream the build into STORE (a folder store, s3://BUCKET/PREFIX or hf://ORG/NAME[@BRANCH], whose "
                   "repo and branch must exist) instead of a build folder: the source is read by byte range (s3://, "
                   "hf:// are not mirrored), each shard is stored as a blob as soon as it is made (on the hub: its "
                   "LFS content sent), the index and manifest are committed last (as publish does).")
@click.option("--scratch-limit", default="4GiB", show_default=True, metavar="SIZE",
              help="With --to: the local disk the build may use (state, metadata, staged shards); refused "
                   "up front if it cannot hold the largest shard.")
@click.option("--executor", default="local", show_default=True, metavar="local|ray|ray://HOST:PORT",
              help="With --to: run the shard jobs in local processes or as tasks on a Ray cluster.")
@_sign_option
@_set_option
@click.option("-q", "--quiet", is_flag=True, help="No progress bars or tables.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary (for CI) instead of tables.")
def compile_cmd(recipe_path, out_dir, jobs, force, no_compile, require_neff, cache, host_profile, cache_push, to,
                scratch_limit, executor, sign, overrides, quiet, as_json):
    """Build a recipe into a build folder, or stream it into a store with --to.

    Build RECIPE: resolve the source, validate it, plan, emit the per-rank shards, write the KV
    and tail layout metadata, trace and compile the decode and tail programs (cpu/cuda: .pt2
    through AOTInductor; trn2/trn3: LNC=1 NEFFs through neuronx-cc), and write the manifest.

    Stages whose inputs are unchanged are skipped (an unchanged recipe does no work); shards are
    written under temporary names and renamed when complete, so an interrupted build resumes
    where it stopped. Without the Neuron SDK a trn build records its NEFF stage as skipped and
    warns; --require-neff makes that an error. With --cache, a program another host compiled with
    the same compile key is fetched and verified instead of compiled.

    With --to STORE the build goes straight into a store, as compile + publish would leave it (the
    same bytes and build id): the source is read by byte range, each shard is staged, stored and
    deleted, and the index is committed last; local disk stays under --scratch-limit (checked up
    front, the peak reported). A killed run's rerun sends only what the store lacks.

    Examples:
      gkbuild compile recipes/tiny-cpu.yaml                  # -> artifacts/tiny-cpu/
      gkbuild compile recipes/gpt-oss-120b-trn3.yaml --cache s3://my-bucket/gk-cache --cache-push
      gkbuild compile recipes/gpt-oss-120b-trn3.yaml --to s3://my-bucket/builds/120b \\
          --scratch-limit 8GiB --sign sigstore
    """
    from .pipeline.pipeline import compile_build
    from .recipe import load

    if jobs is not None and jobs < 1:
        raise GkError(f"--jobs: {jobs} is not a positive number of processes")
    if cache_push and not cache:
        raise GkError("--cache-push: give the store with --cache STORE (or GKBUILD_COMPILE_CACHE)")
    r = load(recipe_path, overrides)
    if host_profile is not None:
        from .paths import resolved

        r.compile.host_profile = str(resolved(host_profile, "--host-profile"))
    if r.compile.host_profile:  # checked before anything is written
        from .compile import hostprofile

        if r.backend != "neuron":
            raise GkError(f"compile.host_profile: a gkbuild doctor profile is for trn2/trn3 builds, not {r.target}")
        hostprofile.of(r)
    if to is None:
        if sign or executor != "local" or scratch_limit != "4GiB":
            opt = "sign" if sign else "executor" if executor != "local" else "scratch-limit"
            raise GkError(f"--{opt}: only for a build streamed into a store (--to STORE)"
                          + ("; a build folder is signed when it is published (publish --sign)" if sign else ""))
        res = compile_build(r, out=out_dir, jobs=jobs, force=force, quiet=quiet or as_json, compile=not no_compile,
                            require_neff=require_neff, cache=cache or None, cache_push=cache_push)
    else:
        from .farm.run import parse_executor
        from .pipeline.stream import stream_build

        if out_dir is not None:
            raise GkError("--out and --to: a streamed build writes into the store, not a folder; give one of them")
        parse_executor(executor)
        res = stream_build(r, to, parse_size(scratch_limit, "--scratch-limit"),
                           executor, jobs=jobs, force=force, quiet=quiet or as_json, compile=not no_compile,
                           require_neff=require_neff, cache=cache or None, cache_push=cache_push, sign=sign)
    if as_json:
        click.echo(json.dumps({**res.summary(), **({"stream": res.stream} if to else {})}, indent=2))
    elif not quiet:
        _print_build(res)
        if to:
            from .summary import human_bytes

            st = res.stream
            out.print(f"-> {st['where']}: {st['blobs_sent']} blobs sent ({human_bytes(st['bytes_sent'])}), "
                      f"{st['shards_already_stored']} shards already stored; peak local disk "
                      f"{human_bytes(st['peak_disk'])} of {human_bytes(st['scratch_limit'])}"
                      + (f" (Ray nodes' staging: {human_bytes(st['peak_disk_workers'])} at the most)"
                         if st.get("peak_disk_workers") is not None else "") + "; source read "
                      f"{human_bytes(st['source_read'])} of {human_bytes(st['source_bytes'])}")


def _print_build(res) -> None:
    from .summary import human_bytes

    s = res.summary()
    t = Table(title=f"build {s['name']} -> {s['build']}", title_justify="left")
    for c in ("stage", "status", "seconds", "detail"):
        t.add_column(c, justify="right" if c == "seconds" else "left")
    colors = {"ran": "green", "cached": "dim", "pending": "yellow", "skipped": "yellow"}
    for st in s["stages"]:
        t.add_row(st["name"], f"[{colors.get(st['status'], 'white')}]{st['status']}[/]", f"{st['seconds']:.2f}",
                  st["detail"])
    out.print(t)
    work = (f"{s['shards_written']} shards written ({human_bytes(s['bytes_written'])})"
            if s["did_work"] else "nothing to do: every stage is up to date")
    out.print(f"{work}; {s['files']} files, {human_bytes(s['bytes'])}, {s['ranks']} ranks; "
              f"build {s['build_id'][:16]} in {s['seconds']:.2f} s")


@cli.command()
@click.argument("build_dir", metavar="BUILD", type=click.Path(path_type=Path))
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
def check(build_dir, quiet):
    """Re-hash every file of a build against its manifest.

    Re-hash every file of BUILD against its manifest; report each mismatched, missing or
    extra file, one per line. Exits 1 if any.

    Examples:
      gkbuild check artifacts/tiny-cpu
    """
    from .pipeline import manifest as mf
    from .pipeline.check import problems

    m = mf.load(build_dir)
    with bar("check", sum(f["size"] for f in m["files"]), quiet) as advance:
        found = problems(build_dir, advance)
    for p in found:
        click.echo(printable(p))  # a file's name is the folder's, not ours: shown, never obeyed
    if found:
        raise GkError(f"{build_dir}: {len(found)} problem(s) against the manifest")
    note(f"ok: {len(m['files'])} files match the manifest (build {m['build_id'][:16]})", quiet)


def _prompt_ids(text: str | None, option: str = "--prompt-ids") -> list[list[int]] | None:
    if not text:
        return None
    try:
        prompts = [[int(t) for t in p.split(",") if t.strip()] for p in text.split(";") if p.strip()]
    except ValueError:
        raise GkError(f"{option}: {text!r} is not a list like '1,2,3;4,5,6'") from None
    if not prompts or not all(prompts):
        raise GkError(f"{option}: give one or more lists of at least one id each, ';'-separated")
    return prompts


def _text_prompts(spec, texts: tuple[str, ...], chat: bool, prompt_ids: str | None):
    """(token ids, {"prompts", "chat"}) of --prompt texts through the checkpoint's tokenizer, or None."""
    if chat and not texts:
        raise GkError("--chat renders --prompt texts with the chat template; give at least one --prompt")
    if not texts:
        return None
    if prompt_ids:
        raise GkError("--prompt and --prompt-ids both give the prompts; use one of them")
    from . import text

    return text.encode(text.tokenizer(spec), list(texts), chat), {"prompts": list(texts), "chat": chat}


_PROMPT = click.option("--prompt", "texts", multiple=True, metavar="TEXT",
                       help="A prompt as text (repeatable), tokenized with the checkpoint's own tokenizer.")
_CHAT = click.option("--chat", is_flag=True, help="Render each --prompt as a user turn of the checkpoint's chat template.")
_DEVICE = click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
                       help="Where the reference (and verify's twins) run.")


@cli.command()
@click.argument("checkpoint")
@click.option("--out", "out_file", required=True, type=click.Path(path_type=Path), help="Golden file to write.")
@_PROMPT
@_CHAT
@click.option("--prompt-ids", default=None, help="Prompts as token ids: '1,2,3;4,5,6'.")
@click.option("--continuation", "continuations", multiple=True, metavar="TEXT",
              help="The given continuation of each --prompt, in order (repeatable, one a prompt): tokenized with the "
                   "checkpoint's tokenizer, appended with no template around it. Makes the golden --forced.")
@click.option("--continuation-ids", default=None,
              help="The continuation of each --prompt-ids prompt as token ids: '7,8;9,10'. Makes the golden --forced.")
@click.option("--forced", is_flag=True,
              help="Teacher-forced: the whole sequence (prompt + continuation) is given and the reference runs every "
                   "position in one layer-major pass, each weight read once (~1x the checkpoint). Without --prompt "
                   "or --prompt-ids the continuation is --steps random tokens. Use it for a remote or large source; "
                   "the default greedy mode reads each generated position's experts again (~3.6x at 120b, 4 x 32).")
@click.option("--prompts", "n_prompts", type=click.IntRange(1, 1 << 12), default=4, show_default=True,
              help="Random prompts, when no --prompt or --prompt-ids.")
@click.option("--prompt-len", type=click.IntRange(1, 1 << 16), default=4, show_default=True,
              help="Length of the random prompts.")
@click.option("--steps", type=click.IntRange(0, 1 << 16), default=16, show_default=True,
              help="Greedy continuation steps after the longest prompt (shorter prompts continue greedily to it); "
                   "with --forced and random prompts, the random continuation's length; refused with a given "
                   "continuation (its length is the continuation's).")
@click.option("--seed", default=0, show_default=True, help="Seed of the random prompts (and forced continuations).")
@click.option("--kv", "kv_dtype", type=click.Choice(["bf16", "fp8_e4m3", "fp8_e4m3fn", "fp32"]), default="bf16",
              show_default=True, help="The KV cache the reference emulates: the build's kv dtype (trn2 FP8 is "
                                      "fp8_e4m3, trn3/cpu/cuda fp8_e4m3fn); fp32 keeps it exact.")
@click.option("--k-scale", type=float, default=1.0, show_default=True, help="FP8 K dequant scale (the recipe's).")
@click.option("--v-scale", type=float, default=1.0, show_default=True, help="FP8 V dequant scale (the recipe's).")
@click.option("--scale-rule", type=click.Choice(SCALE_RULES), default="round_up", show_default=True,
              help="A dense (bf16/fp32) source: how its experts are quantized to MXFP4 for the reference (the build "
                   "recipe's quantize.scale_rule); the golden also holds the dense original's logits over the same "
                   "tokens. An MXFP4 source ignores it.")
@_DEVICE
@click.option("--scratch-limit", default=None, metavar="SIZE",
              help="The most local disk ($GKBUILD_CACHE and $TMPDIR) the golden may take, sampled as it runs (an "
                   "hf:// or s3:// source is read by range, never mirrored); over it, it fails.")
@click.option("--json", "as_json", is_flag=True,
              help="Print what was read as JSON: mode, sequences, positions, source, source_bytes, bytes_read, "
                   "hash_bytes_read, ratio, wall_s, cpu_s, peak_rss_bytes, peak_disk_bytes.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
@click.pass_context
def golden(ctx, checkpoint, out_file, texts, chat, prompt_ids, continuations, continuation_ids, forced, n_prompts,
           prompt_len, steps, seed, kv_dtype, k_scale, v_scale, scale_rule, device, scratch_limit, as_json, quiet):
    """Compute a checkpoint's reference logits, to verify builds against later.

    Reference logits for CHECKPOINT (a folder, hf://ORG/NAME@REV, s3://BUCKET/PREFIX or
    synth://PRESET...; remote ones read by range): each prompt plus a greedy continuation, or with
    --forced a given one, with per-layer hidden states, router choices and margins, the final
    norm's output and every expert on fixed probe rows, saved as safetensors so a build can be
    verified without transformers. The reference streams the checkpoint one decoder layer at a
    time through transformers' GPT-OSS modules (fp32), decodes MXFP4 with transformers' own
    dequantization, and rounds K/V as the build's --kv cache does. A dense (bf16/fp32) fine-tune's
    golden is its MXFP4 reference (experts quantized by --scale-rule, as its build does) plus the
    dense original's logits, from which verify reports the quantization's own effect.

    Bytes read from the source: greedy runs one pass for the prompts and one per generated
    position, each re-reading the experts it routes to (a 36-layer 120b at 4 x 32: ~220 GB of a
    61 GB checkpoint); --forced runs one pass and reads each weight once (~1x, plus the files'
    sha256 when neither the listing nor the fingerprint cache knows it). verify takes either.

    Examples:
      gkbuild golden synth://tiny --out g.safetensors --prompt "The capital of France is" --chat
      gkbuild golden hf://openai/gpt-oss-120b --out g.safetensors --prompt "..." --kv fp8_e4m3
      gkbuild golden s3://bucket/gpt-oss-120b --out g.safetensors --forced --prompts 4 --prompt-len 4 --steps 28 \\
          --scratch-limit 2GiB --json
      gkbuild golden synth://tiny --out g.safetensors --prompt "The capital of France is" --continuation " Paris."
      gkbuild golden ./my-bf16-finetune --out g.safetensors --forced --scale-rule round_up
    """
    import resource
    import time

    from .checkpoint.source import model_config, open_source, parse
    from .golden import default_prompts, for_checkpoint, replaceable
    from .reference import KvFormat, check_size

    wall, cpu = time.monotonic(), time.process_time()
    fmt = KvFormat(kv_dtype, k_scale, v_scale)
    spec = parse(checkpoint, base=Path.cwd())
    replaceable(out_file)  # before minutes of compute
    limit = parse_size(scratch_limit, "--scratch-limit") if scratch_limit is not None else None
    if continuations and not texts:
        raise GkError("--continuation continues a --prompt: give the prompts as text too (one a continuation)")
    if continuation_ids and not prompt_ids:
        raise GkError("--continuation-ids continues --prompt-ids prompts: give those too (one a continuation)")
    given_steps = ctx.get_parameter_source("steps") is not click.core.ParameterSource.DEFAULT
    if (continuations or continuation_ids) and given_steps:
        raise GkError("--steps with a given continuation: the continuation sets the positions; leave --steps out")
    forced = forced or bool(continuations or continuation_ids)
    if forced and (texts or prompt_ids) and not (continuations or continuation_ids):
        raise GkError("--forced with given prompts needs their continuations (--continuation or --continuation-ids)")
    given = _text_prompts(spec, texts, chat, prompt_ids)
    cfg = model_config(spec)
    vocab = cfg.V
    cont = None
    if given:
        prompts, meta = given
        if continuations:
            from . import text

            cont = text.encode(text.tokenizer(spec), list(continuations))
            meta["continuations"] = list(continuations)
    elif prompt_ids:
        prompts, meta = _prompt_ids(prompt_ids), None
        if continuation_ids:
            cont = _prompt_ids(continuation_ids, "--continuation-ids")
    elif forced:
        seqs, meta = default_prompts(vocab, n_prompts, prompt_len + steps, seed), None
        prompts, cont = [s[:prompt_len] for s in seqs], [s[prompt_len:] for s in seqs]
    else:
        prompts, meta = default_prompts(vocab, n_prompts, prompt_len, seed), None
    if any(not 0 <= t < vocab for p in prompts + (cont or []) for t in p):
        raise GkError(f"--prompt-ids: token ids must be in 0..{vocab - 1} (the model's vocabulary)")
    if cont is not None:
        from .golden import forced_sequences

        check_size(cfg, forced_sequences(prompts, cont), 0)
    else:
        check_size(cfg, prompts, steps)
    reads: dict = {}

    def work():
        return for_checkpoint(open_source(spec, ranged=True), prompts, steps, fmt, device, quiet or as_json, meta,
                              cont, reads, scale_rule)

    if limit is None:
        g, disk = work(), None
    else:
        from .scratch import within

        g, disk = within(limit, "golden", work)
    g.save(out_file)
    P, T = g.token_ids.shape
    if as_json:
        read, size = reads.get("bytes"), reads.get("source_bytes")
        click.echo(json.dumps({
            "mode": g.meta["mode"], "sequences": P, "positions": T, "source": spec.uri, "out": str(out_file),
            "source_bytes": size, "bytes_read": read, "hash_bytes_read": reads.get("hash_bytes"),
            "ratio": read / size if read is not None and size else None,
            "wall_s": time.monotonic() - wall, "cpu_s": time.process_time() - cpu,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "peak_disk_bytes": disk}, indent=2))
    else:
        note(f"wrote {out_file}: {P} sequences x {T} positions ({g.meta['mode']}), {kv_dtype} KV")


def _trust_options(f):
    f = click.option("--trust-issuer", default=None, metavar="URL",
                     help="The OIDC issuer of keyless --trust identities (default: GitHub Actions', "
                          "https://token.actions.githubusercontent.com).")(f)
    return click.option("--trust", "trust", multiple=True, metavar="KEY.pub|IDENTITY",
                        help="Refuse the build unless one of these signed it (repeatable: key rotation): a public "
                             "key's PEM file, or a keyless identity such as https://github.com/ORG/REPO/.github/"
                             "workflows/build-artifacts.yml@refs/tags/build-1 (needs gkbuild[sign]).")(f)


@cli.command()
@click.argument("build_dir", metavar="BUILD|STORE")
@click.option("--golden", "golden_file", type=click.Path(path_type=Path), default=None,
              help="Reference logits from `gkbuild golden` (default: computed now from the build's source).")
@_PROMPT
@_CHAT
@click.option("--steps", type=click.IntRange(0, 1 << 16), default=16, show_default=True,
              help="Decode steps after the prompt (no --golden).")
@click.option("--prompts", "n_prompts", type=click.IntRange(1, 1 << 12), default=None,
              help="Random prompts, when no --golden or --prompt (default min(4, batch)).")
@click.option("--engine", type=click.Choice(["twin", "compiled", "neuron"]), default="twin", show_default=True,
              help="twin: the torch twins (any topology, emulated); compiled: the build's .pt2 programs (cpu/cuda); "
                   "neuron: the build's NEFFs on this Trainium host's NeuronCores, every rank (needs the Neuron SDK).")
@_DEVICE
@click.option("--loose", is_flag=True, help="Accept a golden of another KV format, at the loose tolerances.")
@click.option("--allow-other-checkpoint", "other_checkpoint", is_flag=True,
              help="Accept a golden made from another checkpoint than the build's source (or quantized by another "
                   "scale rule).")
@click.option("--quant-tolerance", type=float, default=None, metavar="KL",
              help="A dense (bf16/fp32) source: fail when the build's mean per-position KL divergence from the dense "
                   "original (nats, over the golden's original logits) is above KL. Without it the quantization's "
                   "effect is only reported. Refused for a golden with no original logits.")
@click.option("--prefill", type=click.Choice(["nixl"]), default=None,
              help="Disaggregated inference: a prefill engine (its own process on 127.0.0.1) computes each prompt's "
                   "first N-1 positions, NIXL moves their K/V into the build's cache as the transfer plan says, and "
                   "the decode runs (and is judged) from position N-1 on. Needs gkbuild[di].")
@click.option("--prefill-tp", type=click.IntRange(min=1), default=4, show_default=True,
              help="Prefill ranks (the model's kv heads split over them).")
@click.option("--transfer-timeout", type=click.FloatRange(min=0, min_open=True), default=60.0, show_default=True,
              help="Seconds each exchange with the prefill engine may take, waits between messages included: the "
                   "handshake, its prefill of a prompt set, the NIXL READs, the release of its blocks.")
@click.option("--report", "report_dir", type=click.Path(path_type=Path), default=None, metavar="DIR",
              help="Also write DIR/report.json (what --json prints) and DIR/report.html (plots embedded).")
@click.option("--scratch-limit", default=None, metavar="SIZE",
              help="STORE only: the most local disk ($GKBUILD_CACHE and $TMPDIR) the verify may take, sampled as it "
                   "runs (its files are read from their blobs into memory, never onto disk); over it, it fails.")
@_trust_options
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bars.")
def verify(build_dir, golden_file, texts, chat, steps, n_prompts, engine, device, loose, other_checkpoint,
           quant_tolerance, prefill, prefill_tp, transfer_timeout, report_dir, scratch_limit, trust, trust_issuer, as_json,
           quiet):
    """Run a build (or a store, in place) and compare it with the reference model, layer by layer.

    Run BUILD through the torch twins (every rank emulated, each seeing only its own shards) and
    compare with the reference model: NxD-style tolerances on the reference's top-5/50/1000/all
    logits, teacher forcing, near-tie allowances; tight when the golden emulates the build's KV
    format. Each layer is also run on the reference's own input, every expert of every layer on
    fixed probe rows, and the tail's final norm and lm_head on the reference's numbers. Exits 1 on
    a mismatch and names the first part that departs on its own.

    With --prefill nixl and no --golden, it runs one prompt set per length the SWA N-1 rule must
    cover (longer than the sliding window; N % block == 0 and N % block == block - 1); --report
    then writes one folder a set, DIR/prompt-len-N.

    STORE (a folder store, hf://ORG/NAME[@REVISION] or s3://BUCKET/PREFIX) is verified where it is
    published: each file is read from its blob as the twins first need it and hashed against the
    manifest on the way; the same checks and the same report as of the fetched build. With --trust
    the signature over the manifest is checked before any file is read.

    A build of a dense (bf16/fp32) fine-tune is judged tightly against the MXFP4 reference it was
    built from; the report also states the quantization's own effect (that reference against the
    dense original: per-position KL, top-1 agreement) and the build's distance to the original,
    which --quant-tolerance gates.

    Examples:
      gkbuild verify artifacts/tiny-cpu --prompt "Once upon a time" --chat --report artifacts/report
      gkbuild verify artifacts/gpt-oss-120b-trn3 --golden g.safetensors --json
      gkbuild verify artifacts/tiny-cpu --engine compiled --steps 8 -q
      gkbuild verify s3://bucket/builds/120b --golden g.safetensors --scratch-limit 2GiB --trust ci.pub
      gkbuild verify artifacts/my-bf16-finetune --golden g.safetensors --quant-tolerance 0.05 --report r
    """
    from .publish.shards import is_store
    from .verify import check_prefill, run

    if golden_file is not None and texts:
        raise GkError("--prompt makes a golden now; with --golden the golden's own prompts are used")
    if chat and not texts:
        raise GkError("--chat renders --prompt texts with the chat template; give at least one --prompt")
    quiet = quiet or as_json
    if scratch_limit is not None and not is_store(build_dir):
        raise GkError(f"--scratch-limit bounds a verify of a store; {build_dir} is a build folder on local disk")
    if trust:
        from .publish import signing

        trust = signing.trust_list(trust, trust_issuer)
    kw = dict(golden=golden_file, steps=steps, prompts=n_prompts, texts=list(texts) or None, chat=chat, engine=engine,
              loose=loose, other_checkpoint=other_checkpoint, quiet=quiet, device=device, trust=trust or None,
              quant_tolerance=quant_tolerance)
    if scratch_limit is not None:
        from .scratch import within

        reports = [within(parse_size(scratch_limit, "--scratch-limit"), "verify", lambda: run(build_dir, **kw))[0]]
    elif prefill is None:
        reports = [run(build_dir, **kw)]
    else:
        from .di.decode import serving

        if texts:
            raise GkError("--prefill nixl makes its own prompt sets (one per length the N-1 rule must cover); "
                          "give --golden or no prompts")
        if is_store(build_dir):
            from .publish.shards import twins_only

            twins_only(build_dir, "twin", True)
        check_prefill(engine)  # before a prefill process is started
        with serving(build_dir, prefill_tp, golden_file, n_prompts, transfer_timeout, steps) as (spec, lengths):
            reports = [run(build_dir, **kw, prompt_len=n, prefill=spec) for n in lengths]
    dicts = [r.to_dict() for r in reports]
    if report_dir is not None:
        from . import report

        for rep, d in zip(reports, dicts):  # one folder a DI prompt set (N = its prompt length)
            where = report_dir / f"prompt-len-{rep.prefilled + 1}" if len(reports) > 1 else report_dir
            written = report.write(d, where, f"gkbuild verify {build_dir}")
            note(f"wrote {written[0]} and {written[1]}", quiet)
    if as_json:
        click.echo(json.dumps(dicts[0] if len(dicts) == 1 else dicts, indent=2))
    else:
        for rep in reports:
            _print_verify(rep)
    for rep in reports:
        if not rep.ok:
            raise GkError(rep.failure())


def _print_verify(rep) -> None:
    from .verify import EXPERT_TOL, TAIL_TOL, TOLERANCES

    di = f"; positions 0..{rep.prefilled - 1} prefilled, pulled over NIXL" if rep.prefilled else ""
    t = Table(title=f"verify ({rep.kv} tolerances: golden KV {rep.golden_kv}, build KV {rep.build_kv}{di})",
              title_justify="left")
    for c in ("pos", "top-1 exact/near/wrong", "max |err| top-5", "top-50", "top-1000", "all", "min cosine", ""):
        t.add_column(c, justify="right")
    for s in rep.steps:
        e = s.max_err
        t.add_row(str(s.step), f"{s.top1_exact}/{s.top1_near}/{s.top1_wrong}", f"{e[5]:.4f}", f"{e[50]:.4f}",
                  f"{e[1000]:.4f}", f"{e[None]:.4f}", f"{s.min_cosine:.6f}", "[green]ok[/]" if s.ok else "[red]FAIL[/]")
    out.print(t)
    if rep.texts:
        t = Table(title="continuations (teacher-forced: the build's next-token choice at each position)",
                  title_justify="left")
        for c in ("seq", "prompt", "reference", "build", "agree"):
            t.add_column(c, justify="right" if c in ("seq", "agree") else "left", overflow="fold")
        for i, x in enumerate(rep.texts):
            t.add_row(str(i), *(printable(x[k]) for k in ("prompt", "reference", "build")),
                      f"{x['agree']}/{x['length']}")
        out.print(t, markup=False)
    tol = ", ".join(f"top-{k or 'all'}: {a}+{r}*|ref|" for k, (a, r) in TOLERANCES[rep.kv].items())
    out.print(f"max |err| {rep.max_abs_err:.4f}, min cosine {rep.min_cosine:.6f}; routing forced at true ties "
              f"{rep.routing_forced} of {rep.routing_total} token-layers; tolerances {tol}", markup=False)
    if rep.unjudged:
        out.print(f"note: {rep.unjudged} positions not judged: from a true tie of the reference's routing on, as the "
                  f"compiled programs cannot be steered to its experts (either set is the model's; each tie counts "
                  f"as forced; --engine twin judges them all)", markup=False)
    if rep.unmodeled:
        out.print(f"note: the programs were compiled with {', '.join(rep.unmodeled)}, numerics the twins do not "
                  f"model: this verify vouches for the kernel's reference path, not for what those switches change")
    if rep.layer_errors:
        out.print("hidden-state relative error by layer, free-running worst / on the reference's input worst, median "
                  f"(routing departures; a layer departs above {rep.blame_threshold:.3g} worst or "
                  f"{rep.blame_threshold_median:.3g} median): "
                  + ", ".join(f"L{i}: {e:.3g} / {le:.3g}, {lm:.3g} ({r})" for i, (e, le, lm, r) in
                              enumerate(zip(rep.layer_errors, rep.layer_local_errors, rep.layer_local_median,
                                            rep.layer_routing))), markup=False)
        out.print(f"experts: {rep.experts_checked} checked on the probe rows, worst {max(rep.expert_errors):.3g} "
                  f"(limit {EXPERT_TOL:g}), {len(rep.experts_failing)} departing; routed to by the reference, by layer: "
                  + ", ".join(str(c) for c in rep.coverage), markup=False)
        out.print(f"tail: final norm error {rep.tail_norm_error:.3g}, lm_head error {rep.tail_lm_head_error:.3g} "
                  f"(limit {TAIL_TOL:g})", markup=False)
    if rep.quantization:
        _print_quantization(rep.quantization)


def _print_quantization(q: dict) -> None:
    """The quantization section: the MXFP4 reference's own effect and the build's, from the original."""
    def said(s: dict) -> str:
        if not s["positions"]:
            return "no positions"
        return (f"mean KL {s['mean_kl']:.4g} nats, p99 {s['p99_kl']:.4g}, max {s['max_kl']:.4g} (sequence "
                f"{s['worst'][0]} position {s['worst'][1]}), top-1 agreement {s['top1_agreement']:.1%} over "
                f"{s['positions']} positions")

    gate = "reported only (no --quant-tolerance)" if q["tolerance"] is None else \
        f"--quant-tolerance {q['tolerance']:g}: {'ok' if q['ok'] else 'FAIL'}"
    out.print(f"quantization ({q['source_layout']} original vs MXFP4, scale rule {q['scale_rule']}): the MXFP4 "
              f"reference from the original: {said(q['reference'])}; the build from the original: {said(q['build'])}; "
              f"{gate}", markup=False)


@cli.command()
@click.argument("build_dir", metavar="BUILD", type=click.Path(path_type=Path))
@click.option("--to", "dest", required=True, metavar="DEST",
              help="A folder (local or a mounted artifact store), hf://ORG/NAME[@BRANCH] or s3://BUCKET/PREFIX.")
@click.option("--level", type=click.IntRange(1, 19), default=ZSTD_LEVEL, show_default=True,
              help="zstd level for files that compress (decided per file from a sample).")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=None, help="Files stored in parallel (default: cores).")
@click.option("--prune", is_flag=True, help="Folder and s3:// stores: delete blobs the new index no longer references "
              "(a fetch of the previous build running at the same time would then fail; skipped while another "
              "publish holds a lease on the store).")
@_sign_option
@click.option("-q", "--quiet", is_flag=True, help="No progress bar or table.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def publish(build_dir, dest, level, jobs, prune, sign, quiet, as_json):
    """Publish a build to a folder, hf:// or s3:// store.

    Publish BUILD to DEST: every file hashed against the manifest as it is stored, compressed
    with zstd where that pays, content the store already holds skipped, then the publish index
    written in one step (one commit on the hub), so nobody sees half a build.

    A store holds the build published last: publishing another replaces it (and says so); of two
    publishes at once, the second to commit is refused. Without --sign, a signature beside the
    manifest is published only if it is over exactly this manifest and provenance.

    Examples:
      gkbuild publish artifacts/tiny-cpu --to /mnt/store/tiny-cpu
      gkbuild publish artifacts/gpt-oss-120b-trn3 --to hf://my-org/gpt-oss-120b-gk@trn3
      gkbuild publish artifacts/gpt-oss-120b-trn3 --to s3://my-bucket/builds/gpt-oss-120b-trn3
    """
    from .publish.publish import publish as run

    rep = run(build_dir, dest, level=level, jobs=jobs, prune=prune, quiet=quiet or as_json, sign=sign)
    if as_json:
        click.echo(json.dumps(rep, indent=1))
        return
    if not quiet:
        _print_store_table(rep["entries"], f"published {rep['name']} -> {rep['where']}")
    from .summary import human_bytes

    what = ("already published: nothing uploaded" if rep["already"] else
            f"{rep['uploaded_files']} files uploaded ({human_bytes(rep['uploaded_bytes'])}), "
            f"{rep['files'] + 1 - rep['uploaded_files']} already in the store")
    old = rep.get("replaced")
    replaced = (f"; it replaces build {shown(old['name'])} {str(old['build_id'])[:16]} (a store holds the build "
                f"published last; the old one's blobs stay until --prune)") if old else ""
    note(f"{what}; build {rep['build_id'][:16]}{replaced}", quiet)


def _print_store_table(entries: list[dict], title: str) -> None:
    from .publish.index import by_kind
    from .summary import human_bytes

    t = Table(title=title, title_justify="left")
    for c in ("files", "count", "bytes", "stored", "ratio", "zstd"):
        t.add_column(c, justify="left" if c == "files" else "right")
    for kind, k in by_kind(entries).items():
        t.add_row(kind, str(k["files"]), human_bytes(k["bytes"]), human_bytes(k["stored"]),
                  f"{k['stored'] / max(k['bytes'], 1):.3f}", f"{k['zstd']} of {k['files']}")
    out.print(t)


@cli.command()
@click.argument("src", metavar="SRC")
@click.option("--to", "dest", required=True, type=click.Path(path_type=Path), metavar="DIR",
              help="Folder to fetch into (new, empty, or an interrupted fetch to resume).")
@click.option("--expect", metavar="BUILD_ID", default=None,
              help="Refuse unless the store holds this build (its id, or a prefix of at least 12 hex digits).")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=None, help="Files fetched in parallel.")
@_trust_options
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def fetch(src, dest, expect, jobs, trust, trust_issuer, quiet, as_json):
    """Fetch a published build, every file verified before it is moved into place.

    Fetch the build published at SRC (a folder, hf://ORG/NAME[@REVISION] or s3://BUCKET/PREFIX) into DIR.

    Every file is decompressed as it streams in and moved into place only once its sha256 matches
    the manifest; the manifest is written last. Refused with one line, leaving only verified
    files: a hash mismatch, a path escaping DIR, a file the manifest does not list, data larger
    than declared, an unknown index or manifest version. Run it again to resume.

    Examples:
      gkbuild fetch s3://my-bucket/builds/tiny --to /srv/gk --expect BUILD_ID
      gkbuild fetch s3://my-bucket/builds/120b --to /srv/gk --trust ci-key.pub --trust ci-key-2025.pub
    """
    from .publish.fetch import fetch as run
    from .summary import human_bytes

    from .publish.signing import trust_list

    rep = run(src, dest, expect=expect, jobs=jobs, quiet=quiet or as_json,
              trust=trust_list(trust, trust_issuer) if trust else None)
    if as_json:
        click.echo(json.dumps(rep, indent=1))
    elif rep["already"]:
        note(f"{dest} already holds build {rep['build_id'][:16]}; nothing fetched", quiet)
    else:
        note(f"fetched build {rep['build_id'][:16]} into {dest}: {rep['fetched_files']} files "
             f"({human_bytes(rep['fetched_bytes'])}, {human_bytes(rep['stored_bytes'])} transferred), "
             f"{rep['reused_files']} already verified; every file matches the manifest"
             + (f"; signed by {rep['signed_by']}" if rep["signed_by"] else ""), quiet)


@cli.command("verify-signature")
@click.argument("ref", metavar="BUILD|SRC")
@_trust_options
@click.option("--json", "as_json", is_flag=True, help="Print what the signature and provenance say as JSON.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
def verify_signature(ref, trust, trust_issuer, as_json, quiet):
    """Check who signed a build folder or a store, and that the signature covers it.

    Check that BUILD (a build folder) or SRC (a store: a folder, hf://..., s3://...) is signed by
    one of the --trust keys or identities: the signature must cover exactly its manifest and
    provenance. Prints who signed it and what the provenance says.

    A build folder's files are then checked against the signed manifest (hashed, or hashed before
    on this host for this same manifest): a file changed since signing fails. A store's files are
    not read (nothing is fetched): `gkbuild fetch SRC --trust ...` checks each one as it arrives.

    Examples:
      gkbuild verify-signature artifacts/ci-build --trust ci-key.pub
      gkbuild verify-signature s3://my-bucket/builds/120b \\
          --trust https://github.com/ORG/REPO/.github/workflows/build-artifacts.yml@refs/tags/build-42
    """
    from .pipeline import manifest as mf
    from .publish import signing
    from .publish.fetch import read_manifest, read_signed
    from .publish.stores import open_store

    if not trust:
        raise GkError("verify-signature: give at least one --trust KEY.pub or identity")
    trusted = signing.trust_list(trust, trust_issuer)
    files = None
    if "://" not in ref and (Path(ref) / mf.NAME).exists():
        from .runtime import Build

        build = Build.open(Path(ref), trust=trusted)  # the signature, over exactly this manifest, first
        m, v = build.manifest, build.signature
        try:
            with bar("files", sum(f["size"] for f in m["files"]), quiet or as_json) as advance:
                files = build.verify_files(advance)
        except GkError as e:
            raise GkError(f"{ref}: the signature is good, but a file is not what it signed: {e}") from None
        finally:
            build.close()
    else:
        store = open_store(ref)
        idx, m, man_bytes = read_manifest(store)
        v = signing.verify(man_bytes, read_signed(store, idx), trusted,
                           f"{ref} (build {m['name']} {m['build_id'][:16]})")
    d = {**signing.describe(v), "files_checked": files}
    if as_json:
        click.echo(json.dumps(d, indent=1))
        return
    what = (f"its {files} files match the signed manifest" if files is not None else
            "the store's files were not read: gkbuild fetch checks each against this manifest")
    note(f"ok: build {m['name']} {m['build_id'][:16]} is signed by {d['signed_by']}; built by {d['builder']} "
         f"from {d['source']} (recipe sha256 {str(d['recipe_sha256'])[:16]}); {what}", False)


@cli.command()
@click.argument("a", metavar="BUILD_A")
@click.argument("b", metavar="BUILD_B")
@click.option("--json", "as_json", is_flag=True, help="Print the difference as JSON.")
def diff(a, b, as_json):
    """Show what changed between two builds or stores.

    What changed from BUILD_A to BUILD_B (build folders, or stores: a published folder or
    hf://... or s3://...): recipe keys, source, tool and compiler versions, files, and the ranks whose files
    changed. Exits 0 when the builds are identical, 1 when they differ.

    Examples:
      gkbuild diff artifacts/tiny-cpu s3://my-bucket/builds/tiny --json
    """
    from .publish.diff import diff as run, load

    d = run(load(a), load(b))
    if as_json:
        click.echo(json.dumps(d, indent=1))
    else:
        _print_diff(d)
    if not d["identical"]:
        sys.exit(1)


def _print_diff(d: dict) -> None:
    out.print(f"A: {_cell(d['a']['name'])} build {d['a']['build_id'][:16]}\n"
              f"B: {_cell(d['b']['name'])} build {d['b']['build_id'][:16]}")
    if d["identical"]:
        out.print("identical builds")
        return
    for section in ("recipe", "source", "source_files", "tools", "compile"):
        if d[section]:
            t = Table(title=section.replace("_", " "), title_justify="left")
            for c in ("key", "A", "B"):
                t.add_column(c)
            for c in d[section]:
                t.add_row(_cell(c["key"]), _cell(json.dumps(c["a"])), _cell(json.dumps(c["b"])))
            out.print(t)
    f = d["files"]
    if f["changed"] or f["added"] or f["removed"]:
        t = Table(title="files", title_justify="left")
        for c in ("change", "path", "bytes A", "bytes B"):
            t.add_column(c)
        for c in f["changed"]:
            t.add_row("changed", _cell(c["path"]), str(c["a"]), str(c["b"]))
        for p in f["added"]:
            t.add_row("added", _cell(p), "", "")
        for p in f["removed"]:
            t.add_row("removed", _cell(p), "", "")
        out.print(t)
    r = d["ranks"]
    out.print(f"ranks whose files changed: {r['changed']} of {r['of']}" + (f" ({r['which']})" if r["which"] else ""))


@cli.group()
def cache():
    """A shared compile cache: list, fill, prune.

    The cache is a folder, hf://ORG/NAME or s3://BUCKET/PREFIX.

    Examples:
      gkbuild compile recipes/tiny-cpu.yaml --cache s3://my-bucket/gk-cache --cache-push
      gkbuild cache ls s3://my-bucket/gk-cache
    """


@cache.command("ls")
@click.argument("store", metavar="STORE")
@click.option("--json", "as_json", is_flag=True, help="Print the entries as JSON.")
def cache_ls(store, as_json):
    """List the compiled programs in a compile cache.

    Every compiled program in STORE: its key, program, format, target, compiler and size.

    Examples:
      gkbuild cache ls s3://my-bucket/gk-cache --json
    """
    from .compile.cache import entries
    from .publish.stores import open_store
    from .summary import human_bytes

    st = open_store(store)
    st.require()
    es = entries(st)
    if as_json:
        click.echo(json.dumps(es, indent=1))
        return
    t = Table(title=f"compile cache {store}: {len(es)} programs", title_justify="left")
    for c in ("key", "program", "format", "target", "compiler", "bytes"):
        t.add_column(c, justify="right" if c == "bytes" else "left")
    for e in es:
        a = e.get("artifact")
        if a is None:
            t.add_row(e["key"][:16], f"[red]{e['error']}[/]", "", "", "", "")
        else:
            t.add_row(e["key"][:16], e["program"], a["format"], a["target"],
                      f"{a['compiler']['name']} {a['compiler']['version']}", human_bytes(a["size"]))
    out.print(t)


@cache.command("push")
@click.argument("store", metavar="STORE")
@click.argument("build_dir", metavar="BUILD", type=click.Path(path_type=Path))
def cache_push(store, build_dir):
    """Store a build's compiled programs in a compile cache.

    Store BUILD's compiled programs in STORE under their compile keys (each checked against the
    manifest first; keys the store already has are skipped).

    Examples:
      gkbuild cache push s3://my-bucket/gk-cache artifacts/tiny-cpu
    """
    from .compile.cache import CompileCache, push_build

    c = CompileCache(store, push=True, staging=Path(build_dir) / ".gkbuild" / "cache-push")
    n = push_build(c, Path(build_dir))
    note(f"{len(c.pushed)} programs pushed to {store}, {n - len(c.pushed)} already there", False)


@cache.command("prune")
@click.argument("store", metavar="STORE")
@click.option("--keep", "keep", multiple=True, type=click.Path(path_type=Path), metavar="BUILD",
              help="Keep only the programs these builds use (repeatable); without it, only broken entries "
                   "and blobs no entry names are removed.")
def cache_prune(store, keep):
    """Drop a compile cache's broken or unused entries, then the blobs no entry names.

    Remove entries whose blob is gone or malformed, entries no --keep build uses, then blobs no
    entry names. Only names a push writes are ever deleted.

    Examples:
      gkbuild cache prune s3://my-bucket/gk-cache --keep artifacts/gpt-oss-120b-trn3
    """
    from .compile.cache import build_keys, prune
    from .publish.stores import open_store
    from .summary import human_bytes

    keys = set().union(*(build_keys(Path(b)) for b in keep)) if keep else None
    rep = prune(open_store(store), keys)
    note(f"removed {rep['entries_removed']} entries and {rep['blobs_removed']} blobs "
         f"({human_bytes(rep['bytes_freed'])}); {rep['entries_kept']} programs kept", False)


@cli.command(help=f"""List (or clear) the publishes in progress on a store, which block prunes.

    The leases in STORE (a folder or s3://BUCKET/PREFIX): each publish in progress
    holds one, and while one is live `publish --prune` and `cache prune` delete no blob. A lease
    counts until its expiry, and never longer than {(TTL + SKEW) / 60:.0f} minutes after the store
    last wrote it (a malformed one, or one dated far ahead, stops blocking then), and not at all
    once its process is gone, when it was written on this host. --clear removes one now: only when
    its publish is known to be dead (its blobs would be pruned under it); the lease of a publish
    running on this host needs --force.

    Examples:
      gkbuild leases s3://my-bucket/builds/120b
      gkbuild leases /mnt/store/tiny-cpu --clear leases/OWNER.json
    """)
@click.argument("store", metavar="STORE")
@click.option("--clear", "names", multiple=True, metavar="LEASE",
              help="Remove this lease (leases/<id>.json, as listed; repeatable): a publish that died and left "
                   "one that still blocks prunes.")
@click.option("--force", is_flag=True, help="With --clear: remove a lease even though its publish runs now on "
                                            "this host (a prune may then delete the blobs it has sent).")
@click.option("--json", "as_json", is_flag=True, help="Print the leases as JSON.")
def leases(store, names, force, as_json):
    import time

    from .publish import leases as ls
    from .publish.stores import open_store

    st = open_store(store)
    st.require()
    if names:
        for n in ls.clear(st, list(names), force):
            note(f"removed {n}", as_json)
    now = time.time()
    held = ls.leases(st)
    if as_json:
        click.echo(json.dumps([{"name": h.name, "record": h.doc, "until": h.until, "live": h.until > now,
                                "problem": h.problem} for h in held], indent=1))
        return
    for h in held:
        note(("live: " if h.until > now else "expired: ") + h.describe(now))
    if not held:
        note(f"{st.uri}: no leases")


@cli.group()
def di():
    """Disaggregated inference: plan how a prefill engine's KV reaches a build's cache.

    Disaggregated inference: how a prefill engine's KV reaches a build's cache over NIXL.

    Examples:
      gkbuild di plan recipes/gpt-oss-120b-trn3.yaml --prefill-tp 4
    """


@di.command("plan")
@click.argument("target", metavar="BUILD|RECIPE", type=click.Path(path_type=Path))
@click.option("--prefill-tp", type=click.IntRange(min=1), default=4, show_default=True,
              help="Prefill ranks (the model's kv heads split over them).")
@_set_option
@click.option("--json", "as_json", is_flag=True, help="Print the whole plan as JSON (every decode rank's reads).")
def di_plan(target, prefill_tp, overrides, as_json):
    """Show which prefill bytes fill which decode KV block, for a build or a recipe.

    The transfer plan of a build (a folder with a manifest: its layout/kv.json) or of a recipe
    (the kv.json it would write, no weights read): the regions the prefill engine registers
    (seed 000's native per-layer engine: a [2, blocks, kv/TP, block, d] buffer a layer pair, one
    region a K or V half), and for every decode rank, layer and half which prefill rank, region,
    byte offset and length it reads a block from; the SWA N-1 rule as both roles apply it; what
    converts packed FP8 K, and where.

    Examples:
      gkbuild di plan artifacts/gpt-oss-120b-trn3 --prefill-tp 4
      gkbuild di plan recipes/gpt-oss-120b-trn3.yaml --json > plan.json
    """
    from .di.plan import transfer_plan

    if target.is_dir():
        from .di.decode import plan_of
        from .runtime import Build

        if overrides:
            raise GkError("--set applies to a recipe, not to a build")
        build = Build.open(target)
        try:
            plan = plan_of(build, prefill_tp)
        finally:
            build.close()
    else:
        from .pipeline.pipeline import layout_docs

        p, _ = _load_plan(target, overrides, offline_preset=True)
        doc = json.loads(json.dumps(layout_docs(p)["layout/kv.json"]))
        plan = transfer_plan(doc, prefill_tp, p.config.sliding_window)
    if as_json:
        click.echo(json.dumps(plan, indent=1))
        return
    _print_di_plan(plan)


def _print_di_plan(plan: dict) -> None:
    from .plan import group_ranks, rank_ranges
    from .summary import human_bytes

    d, p = plan["decode"], plan["prefill"]
    out.print(f"decode: {d['world_size']} ranks, {d['form']} KV ({d['entries']} entries of {d['num_blocks']} blocks), "
              f"{d['dtype']}{' packed K' if d['packed'] else ''}, block {d['block_size']} x d {d['head_dim']}, "
              f"{d['kv_heads_per_rank']} kv head(s) a rank, block_len {d['block_len']} B")
    out.print(f"prefill: TP{p['tp']}, {p['kv_heads_per_rank']} of {p['kv_heads']} kv heads a rank "
              f"({', '.join(f'rank {i}: {h}' for i, h in enumerate(p['heads_of_rank']))}), {p['layout']}, "
              f"block_len {p['block_len']} B")
    t = Table(title="what each layer reads (every decode rank)", title_justify="left")
    for c in ("layer", "half", "block group", "decode region (entry)", "decode region offset", "prefill region (buffer)"):
        t.add_column(c, justify="right")
    regions = d["regions"]
    for rd in plan["ranks"][0]["reads"]:
        t.add_row(str(rd["layer"]), rd["half"], rd["group"], f"{rd['decode_region']} ({regions[rd['decode_region']]['entry']})",
                  human_bytes(rd["decode_region_offset"]), f"{rd['prefill_region']} ({rd['prefill_region'] // 2})")
    out.print(t)
    t = Table(title="which prefill rank and bytes of its block fill a decode block", title_justify="left")
    for c in ("decode ranks", "kv heads", "prefill rank", "prefill offset", "decode offset", "length"):
        t.add_column(c, justify="right")
    for grp in group_ranks((r["rank"], {"heads": r["kv_heads"], "segments": r["reads"][0]["segments"]})
                           for r in plan["ranks"]):
        for s in grp["segments"]:
            t.add_row(rank_ranges(grp["ranks"]), str(grp["heads"]), str(s["prefill_rank"]), str(s["prefill_offset"]),
                      str(s["decode_offset"]), str(s["length"]))
    out.print(t)
    out.print(f"bytes of block b: decode {plan['offsets']['decode']}; prefill {plan['offsets']['prefill']}")
    out.print(f"SWA N-1 rule (window {plan['window']}): prefill {plan['swa']['prefill']}; decode {plan['swa']['decode']}")
    k = plan["k_conversion"]
    out.print(f"packed FP8 K: {k['where']} ({k['why']})" if k else "K is not packed: every block is copied as it is")

@cli.command()
@click.argument("recipe_paths", metavar="RECIPE...", nargs=-1, required=True, type=click.Path(path_type=Path))
@_set_option
@click.option("--vary", multiple=True, metavar="KEY=[V1, V2]",
              help="Plan every recipe once per value of KEY (a YAML list), e.g. --vary "
                   f"'decode.batch_sizes=[[1], [8]]'; several --vary options cross (at most {MAX_PLANS} plans: "
                   "recipes x values; more is refused before planning).")
@click.option("--cache", "cache", metavar="STORE", envvar="GKBUILD_COMPILE_CACHE", required=True,
              help="The compile cache the jobs push to (folder, hf://ORG/NAME, s3://BUCKET/PREFIX); env "
                   "GKBUILD_COMPILE_CACHE.")
@click.option("--executor", default="local", show_default=True, metavar="local|ray|ray://HOST:PORT",
              help="local: processes on this host; ray: the Ray cluster RAY_ADDRESS names (or one on this host, "
                   "else a new local one); ray://HOST:PORT: a Ray cluster's client address.")
@click.option("--jobs", "-j", "workers", type=click.IntRange(min=1), default=1, show_default=True,
              help="local executor: programs compiled at once (a NEFF compile takes tens of GB).")
@click.option("--retries", type=click.IntRange(0, 10), default=2, show_default=True,
              help="ray: times Ray reruns a job whose worker died (a compile error is not retried).")
@click.option("--list", "list_only", is_flag=True, help="Only print the jobs the cache misses; compile nothing.")
@click.option("--only", metavar="KEY", default=None,
              help="Run exactly the job of this compile key (as --list prints it; 12+ hex digits): a CI matrix "
                   "cell.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar or table.")
def farm(recipe_paths, overrides, vary, cache, executor, workers, retries, list_only, only, as_json, quiet):
    """Compile every program of every recipe as jobs that meet in the compile cache.

    Compile every program of every RECIPE as independent jobs that meet in the compile cache.

    Plans each program (name, batch size, target, compile key) from the recipe and the model's
    config alone, skips those STORE already holds and verifies, runs the rest as jobs (each traces
    and compiles one program in its own folder and pushes it, conditionally, to STORE), and prints
    one row a job: key, program, recipes, where it ran, seconds, and compiled, cached or failed.
    Exits 1 if any job failed. Afterwards `gkbuild compile RECIPE --cache STORE` on any host
    assembles the build without compiling.

    Examples:
      gkbuild farm recipes/gpt-oss-20b-trn3.yaml recipes/gpt-oss-120b-trn3.yaml \\
          --vary 'decode.batch_sizes=[[1, 8], [64]]' --cache s3://my-bucket/gk-cache --executor ray
      gkbuild farm recipes/*.yaml --cache s3://my-bucket/gk-cache --list --json   # the CI matrix
      gkbuild farm recipes/*.yaml --cache s3://my-bucket/gk-cache --only 3f2a9c0d41be  # one cell
    """
    from .farm.run import run

    rep = run(list(recipe_paths), cache, list(overrides), list(vary), executor, workers, retries, list_only, only,
              quiet=quiet or as_json)
    if as_json:
        click.echo(json.dumps(rep, indent=1))
    elif not quiet:
        _print_farm(rep, list_only)
    if not list_only and rep["failed"]:
        raise GkError(f"farm: {rep['failed']} of {len(rep['jobs'])} jobs failed")


def _print_farm(rep: dict, list_only: bool) -> None:
    colors = {"compiled": "green", "cached": "dim", "failed": "red", "missing": "yellow"}
    title = (f"{len(rep['jobs'])} of {rep['planned']} programs missing from {rep['cache']}" if list_only else
             f"farm -> {rep['cache']} ({rep['executor']}): {rep['compiled']} compiled, {rep['cached']} cached, "
             f"{rep['failed']} failed in {rep['seconds']:.1f} s")
    t = Table(title=title, title_justify="left")
    cols = ("key", "program", "batch", "target", "recipes") + (() if list_only else ("where", "seconds")) + ("status",)
    for c in cols:
        t.add_column(c, justify="right" if c == "seconds" else "left")
    for j in rep["jobs"]:
        status = j["status"] + (f": {j['error']}" if j.get("error") else "")
        ran = () if list_only else (j["where"], f"{j['seconds']:.1f}")
        t.add_row(j["key"][:16], j["program"], j["batch_size"], j["target"], ", ".join(j["recipes"]), *ran,
                  f"[{colors[j['status']]}]{_cell(status)}[/]")
    out.print(t)


@cli.command()
@click.option("--target", type=click.Choice(["trn2", "trn3"]), default="trn3", show_default=True,
              help="The target whose compiler the probes compile for.")
@click.option("--kernels", "kernels_recipe", metavar="RECIPE", type=click.Path(path_type=Path), default=None,
              help="Also check out RECIPE's kernel libraries and compare the switches they read with recipe-doc's.")
@click.option("--report", "report_dir", metavar="DIR", type=click.Path(path_type=Path), default=None,
              help="Write DIR/doctor.json (the host profile compile --host-profile follows) and DIR/doctor.html.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def doctor(target, kernels_recipe, report_dir, as_json):
    """On a Neuron host: answer what the sources cannot, with probe kernels of its own.

    On a Neuron host: answer what the published sources cannot (how MX experts reach the kernel,
    E4M3 flavour mixing, K/V aliases, where the NEFF lands, FP8 saturation, the checkout's switches)
    with probe kernels compiled through the same torch_neuronx.trace call a build makes, on the
    device when one is present, else trace-only. Needs the Neuron SDK.

    Examples:
      gkbuild doctor --report doctor/
      gkbuild doctor --target trn3 --kernels recipes/gpt-oss-120b-trn3.yaml --json
    """
    from .compile import doctor as dr

    rep = dr.run(target, kernels_recipe, quiet=as_json, report=report_dir)
    if report_dir is not None:
        dr.write(rep, report_dir)
    if as_json:
        click.echo(json.dumps(rep, indent=2))
        return
    sdk = ", ".join(f"{k} {v or 'not installed'}" for k, v in rep["sdk"].items())
    out.print(f"SDK: {escape(sdk)}\ninstance {escape(rep['instance'])}, NeuronCore-{rep['neuroncore']}, device "
              f"{'present' if rep['device']['present'] else 'absent'}: probes ran {rep['mode']}")
    t = Table(title=f"gkbuild doctor ({target})", title_justify="left")
    for c in ("item", "answer", "evidence", "what gkbuild does"):
        t.add_column(c)
    for i in rep["items"]:
        t.add_row(i["id"], escape(i["shown"]), escape(i["evidence"] or ""), escape(i["action"]))
    out.print(t)
    if report_dir is not None:
        out.print(f"wrote {report_dir}/doctor.json and doctor.html; build with --host-profile {report_dir}/doctor.json")


@cli.command("recipe-doc")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--matrix", is_flag=True, help="Print the support matrix instead: target x KV dtype/packing x form x "
                                             "experts, judged by the compiler's documented rules before any trace.")
def recipe_doc(as_json, matrix):
    """List every recipe key and kernel switch, or (--matrix) the support matrix.

    Every recipe.yaml key with its default and meaning, then every kernel switch of each kernel
    revision gkbuild knows: how the revision reads it, what it does, and what gkbuild sets it to.
    --matrix: what the published kernels compile, refuse (the rule) or leave to `gkbuild doctor`.

    Examples:
      gkbuild recipe-doc
      gkbuild recipe-doc --matrix
      gkbuild recipe-doc --json
    """
    if matrix:
        return _print_matrix(as_json)
    from .compile.switches import switch_table
    from .recipe import schema_doc

    rows, switches = schema_doc(), switch_table()
    if as_json:
        click.echo(json.dumps({"keys": [dict(zip(("key", "default", "doc"), r)) for r in rows],
                               "switches": switches}, indent=2))
        return
    t = Table(title="recipe.yaml keys", title_justify="left")
    for c in ("key", "default / choices", "meaning"):
        t.add_column(c)
    for row in rows:
        t.add_row(*row)
    out.print(t)
    for rev, entries in switches.items():
        s = Table(title=f"compile.kernel_switches of {rev} (each set explicitly; a recipe value overrides it for "
                        f"the decode)", title_justify="left")
        for c in ("switch", "read as", "gkbuild sets", "numerics", "effect"):
            s.add_column(c)
        for e in entries:
            s.add_row(e["name"], e["read"] + (f" (default {e['default']!r})" if e["default"] is not None else ""),
                      repr(e["value"]), e["numerics"], e["effect"])
        out.print(s)


def _print_matrix(as_json: bool) -> None:
    from .compile.rules import RULES, matrix

    rows = matrix()
    if as_json:
        click.echo(json.dumps({"rules": {k: vars(r) for k, r in RULES.items()}, "matrix": rows}, indent=2))
        return
    t = Table(title="support matrix of the published kernels: the decode program (the tail takes no FP8 or MX "
                    "argument)", title_justify="left")
    for c in ("target", "KV", "form", "experts", "verdict", "rule", "why / what decides it"):
        t.add_column(c)
    for r in rows:
        why = r["line"] if r["status"] != "unknown" else f"gkbuild doctor: {r['doctor']}; {r['line']}"
        t.add_row(r["target"], r["kv"], r["form"], r["experts"], r["status"], r["rule"] or "",
                  escape("; ".join(filter(None, [why, *r["notes"]]))))
    out.print(t)
    for k, r in RULES.items():
        click.echo(f"{k}: {r.says} ({r.source})")


# Libraries that transformers imports behind our back and that log at import, not about our work:
# transformers/quantizers/auto.py imports quantizer_torchao (hence torchao) whenever torchao is
# installed; torchao/__init__.py:96 warns for each CUDA-only .so it cannot load, and its
# register_constant calls make torch/utils/_pytree.py:630 warn per Enum. A CLI line is ours alone.
_IMPORT_NOISE = ("torchao", "torch.utils._pytree")


def main(argv=None) -> None:
    import logging

    for name in _IMPORT_NOISE:
        logging.getLogger(name).setLevel(logging.ERROR)
    for stream in (sys.stdout, sys.stderr):  # names from files are data: a lone surrogate prints escaped
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    try:
        cli.main(args=argv, prog_name="gkbuild", standalone_mode=False)
    except GkError as e:  # its text may hold a peer's or a file's: printed escaped, never obeyed
        click.echo(f"gkbuild: error: {printable(str(e))}", err=True)
        sys.exit(1)
    except OSError as e:  # a full disk, a read-only file system, a folder where a file should be...
        from .errors import os_error

        click.echo(f"gkbuild: error: {printable(os_error(e))}", err=True)
        sys.exit(1)
    except click.exceptions.Abort:
        click.echo("gkbuild: interrupted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        click.echo("gkbuild: interrupted", err=True)
        sys.exit(130)
