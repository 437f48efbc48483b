"""``gkbuild verify --engine neuron``: a build's Neuron programs run on the NeuronCores of a Trainium
host, every rank, teacher-forced on a golden; the logits come back for the same comparison as the
twins'.

One process a rank (``torchrun --nproc-per-node=<world> -m gkbuild.compile.neuron_run``, the XLA
distributed backend): rank r loads its own shards (``Build.load_rank``), keeps its KV allocations on
its NeuronCore, and each step builds the same control inputs as the twins' driver
(``driver.Controls``, converted and checked by ``kernel_inputs``), calls the recipe's decode kernel
on them, gathers the batch's hidden states and calls the tail kernel, which emits this rank's
vocabulary slice of the logits. The calls are the ones the build traced (same kernels, arguments,
switches, set from each program's manifest record before its kernel is imported, flags, and the
host profile's carrier dtypes and runtime environment), so the SDK's compile cache serves the
programs the build compiled. Rank r writes its slices to
``OUT/logits-r<r>.pt``; the caller joins them.

Needs the Neuron SDK and NeuronCores; without them ``check`` says so in one line. Not run on the
machines gkbuild is developed on: only its refusals and its launch line are tested there.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ..errors import GkError
from . import neuron


def check(m: dict) -> list[dict]:
    """The build's compiled Neuron programs, or one line saying why this engine cannot run."""
    why = neuron.sdk()
    if why:
        raise GkError(f"--engine neuron: {why}; it runs a build's NEFFs on a Trainium host")
    if m["compile"].get("backend") != "neuron" or m["compile"]["status"] != "ok":
        raise GkError(f"--engine neuron: this build has no Neuron programs ({m['compile']['status']}); build it with "
                      f"--require-neff where the Neuron SDK is installed")
    arts = [a for a in m["compile"]["artifacts"] if a["format"] == "neff"]
    if not next((a for a in arts if a["program"] == "tail"), {}).get("scalars", {}).get("emit_logits"):
        raise GkError("--engine neuron: the build's tail does not emit logits (tail.emit_logits: false), and verify "
                      "compares logits; build a verification variant with tail.emit_logits: true")
    return arts


def command(build_dir: Path, golden: Path, out: Path, world: int, batch: int) -> list[str]:
    return ["torchrun", "--standalone", f"--nproc-per-node={world}", "-m", "gkbuild.compile.neuron_run",
            str(build_dir), str(golden), str(out), str(batch)]


def run(build, golden_path: Path, batch: int, out: Path):
    """Launch every rank; returns the joined logits [batch rows, T, V] in batch order."""
    import torch

    arts = check(build.manifest)
    if not any(a["batch_size"] == batch for a in arts):
        raise GkError(f"--engine neuron: no program for batch {batch} (built for "
                      f"{sorted({a['batch_size'] for a in arts})})")
    out.mkdir(parents=True, exist_ok=True)
    cmd = command(build.root, golden_path, out, build.world_size, batch)
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_NEURON_MEGA_")}  # each rank sets them
    profile = build.manifest["compile"].get("host_profile")
    env.update(profile.get("runtime_env", {}) if isinstance(profile, dict) else {})  # what doctor asked of the runtime
    done = subprocess.run(cmd, env=env)
    if done.returncode != 0:
        raise GkError(f"--engine neuron: a rank failed (exit {done.returncode}); see its output above")
    vtp = build.manifest["topology"]["vtp"]
    return torch.cat([torch.load(out / f"logits-r{r}.pt") for r in range(vtp)], dim=-1)


def _worker(build_dir: str, golden_path: str, out: str, batch: int) -> None:  # pragma: no cover - Trainium only
    import torch
    import torch.distributed as dist
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.xla_backend  # noqa: F401 - registers the "xla" backend
    from nki.collectives import ReplicaGroup

    from ..checkpoint.source import cache_root
    from ..golden import Golden
    from ..kernels import kernel_inputs
    from ..kernels.driver import Controls
    from ..layout.tail import owned_rows
    from ..runtime import Build
    from . import hostprofile, kernel_source
    from .neuron_trace import load_kernel

    dist.init_process_group("xla")
    rank, dev = dist.get_rank(), xm.xla_device()
    b = Build.open(build_dir)
    m, g = b.manifest, Golden.load(Path(golden_path))
    t = m["topology"]
    arts = {a["program"]: a for a in m["compile"]["artifacts"] if a["batch_size"] == batch}

    def kernel(a):
        """The program's kernel, imported with its recorded switches set (some are read at import)."""
        for n, s in (a["kernel"]["switches"] or {}).items():
            os.environ[n] = s["value"]
        src = kernel_source.parse(a["kernel"]["library"], Path(build_dir))
        return load_kernel(a["kernel"]["entry"], kernel_source.import_roots(kernel_source.checkout(src, cache_root())))

    def scalars(a):
        s = dict(a["scalars"])
        for k in ("tp_replica_group", "ep_replica_group"):
            if k in s:
                s[k] = ReplicaGroup(tuple(tuple(x) for x in s[k]))
        if "hop_meshes" in s:  # the tail builds its ReplicaGroups itself
            s["hop_meshes"] = tuple(tuple(tuple(x) for x in mesh) for mesh in s["hop_meshes"])
        return s

    kernels = {p: kernel(a) for p, a in arts.items()}
    weights = {k: v.to(dev) for k, v in b.load_rank(rank).items()}
    host = b.load_host().get("embed_tokens")
    kv = {k: v.to(dev) for k, v in b.allocate_kv().arguments().items()}
    P, T = g.token_ids.shape
    rows = torch.arange(batch) % P
    steps = Controls(m, b.kv_layout(), batch, T)
    mine = owned_rows(rank % t["vtp"], t["vtp"], batch, t["hops"], t["a2a_batch_groups"])
    logits = []
    for pos in range(T):
        ctl = steps.next()[rank // t["tp"]]
        tokens = g.token_ids[rows, pos]
        dec = arts["decode"]
        for n, s in (dec["kernel"]["switches"] or {}).items():
            os.environ[n] = s["value"]
        given = kernel_inputs.decode_given(m, rank, tokens, ctl, weights, kv, host)
        args = kernel_inputs.assemble(dec["inputs"], given, dec["name"])
        relied = dec["kernel"].get("host_profile") or {}
        args = [a.view(getattr(torch, c)) if (c := hostprofile.carrier(i["name"], i["dtype"], relied)) else a
                for i, a in zip(dec["inputs"], args)]  # the carrier dtypes the build traced with
        outs = kernels["decode"](**{i["name"]: a.to(dev) for i, a in zip(dec["inputs"], args)}, **scalars(dec))
        x_out, *updated = outs if isinstance(outs, (tuple, list)) else (outs,)
        kv.update(zip([i["name"] for i in dec["inputs"] if i["kind"] == "kv_buffer"], updated))
        gathered = [torch.empty_like(x_out) for _ in range(t["world_size"])]
        dist.all_gather(gathered, x_out)
        tl = arts["tail"]
        for n, s in (tl["kernel"]["switches"] or {}).items():
            os.environ[n] = s["value"]
        given = {"hidden_states": torch.cat(gathered).cpu(), **{k: weights[k].cpu() for k in ("gamma", "lm_head_weight_t")},
                 "sampling_params": torch.zeros(len(mine), tl["inputs"][-1]["shape"][1])}
        args = kernel_inputs.assemble(tl["inputs"], given, tl["name"])
        outs = kernels["tail"](**{i["name"]: a.to(dev) for i, a in zip(tl["inputs"], args)}, **scalars(tl))
        logits.append(outs[0].cpu().float())  # emit_logits: this rank's [B, V/VTP] slice comes first
    if rank < t["vtp"]:
        torch.save(torch.stack(logits, dim=1), Path(out) / f"logits-r{rank}.pt")  # [B, T, V_s]


if __name__ == "__main__":  # pragma: no cover - Trainium only
    _worker(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
