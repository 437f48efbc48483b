"""The Neuron backend: the GK decode and the sampling-tail NKI kernels compiled to LNC=1 NEFFs.

What it runs on a Trainium host (Neuron SDK: torch-neuronx, torch-xla, neuronx-cc, nki; and the
recipe's pinned nki-library importable), for each program (decode, tail):

1. call the NKI kernel on XLA tensors shaped like the program's signature (weights, per-buffer
   K/V, control inputs), with the plan's scalars and rank meshes (``kernel_arguments``);
2. take the HLO module proto of its outputs (``torch_xla._XLAC._get_xla_tensors_hlo_proto``);
3. run ``invocation(...)``, printed by ``gkbuild plan --show-compile``:
       neuronx-cc compile --framework=XLA .gkbuild/neuron/<program>.hlo.pb --output compiled/<program>.neff
         --target=<trn2|trn3> --lnc=1 --model-type=transformer --auto-cast=none -O<level>
         --logfile=.gkbuild/neuron/<program>.neuronx-cc.log
   (the HLO and the compiler log stay in the build's state folder; only NEFFs are the build)
4. read the NEFF header (``neff.read``) into the manifest.

One NEFF a program serves every rank (an SPMD kernel: rank_id is an input). Nothing here is
imported until a Neuron build runs; without the SDK the stage is recorded as skipped.
"""

from __future__ import annotations

import importlib
import inspect
import subprocess
from importlib import metadata
from pathlib import Path

from ..errors import GkError
from ..layout.tail import compose_hops
from .signature import Signature

COMPILER = "neuronx-cc"
SDK_MODULES = ("torch_neuronx", "torch_xla", "neuronxcc", "nki")
KERNELS = {
    "decode": ("nkilib_src.nkilib.models.gpt_oss.c128_giga_kernel.experimental.gpt_oss.gpt_oss_decode_layer_dp_tp_ep",
               "gpt_oss_decode_mega_kernel"),
    "tail": ("nkilib.experimental.gpt_oss_tail", "gpt_oss_tail_chunked_megakernel"),
}
# signature name -> the GK kernel's argument name, where they differ
DECODE_NAMES = {"x": "x_shard", "block_table": "active_blocks_table", "block_table_swa": "active_blocks_table_swa",
                "pos": "pos_ids", "pos_swa": "pos_ids_swa", "swa_start": "swa_start_pos_ids",
                "update_idx": "kv_cache_update_idx", "update_idx_swa": "kv_cache_update_idx_swa"}
TAIL_NAMES = {"hidden": "hidden_states"}


def sdk() -> str | None:
    """None when the Neuron SDK imports, else why not."""
    missing = []
    for m in SDK_MODULES:
        try:
            importlib.import_module(m)
        except ImportError:
            missing.append(m)
    return f"Neuron SDK not installed (no {', '.join(missing)})" if missing else None


def compiler() -> dict:
    try:
        version = metadata.version("neuronx-cc")
    except metadata.PackageNotFoundError:
        version = None
    return {"name": COMPILER, "version": version}


def flags(recipe) -> list[str]:
    return [f"--target={recipe.target}", "--lnc=1", "--model-type=transformer", "--auto-cast=none",
            f"-O{recipe.compile.optimization_level}"]


def invocation(program: str, recipe, build_dir: Path) -> list[str]:
    """The exact neuronx-cc command line for one program of a build in ``build_dir``."""
    work, out = workdir(build_dir), Path(build_dir) / "compiled"
    return [COMPILER, "compile", "--framework=XLA", str(work / f"{program}.hlo.pb"), "--output",
            str(out / f"{program}.neff"), *flags(recipe), f"--logfile={work / f'{program}.neuronx-cc.log'}"]


def workdir(build_dir: Path) -> Path:
    from ..pipeline.state import STATE_DIR

    return Path(build_dir) / STATE_DIR / "neuron"


def kernel_arguments(plan, program: str) -> dict:
    """The non-tensor arguments the kernel takes: scalars and rank meshes from the plan."""
    s, t, r = plan.scalars, plan.recipe.topology, plan.recipe
    if program == "tail":
        return {"eps": s["eps"], "hidden_actual": s["hidden_actual"], "zero_interleaved_pad": True,
                "k": r.tail.k, "emit_logits": r.tail.emit_logits,
                "hop_meshes": compose_hops(t.vtp, r.hops), "a2a_batch_groups": t.a2a_batch_groups}
    b = max(r.decode.batch_sizes)
    return {"tp_replica_group": plan.meshes["tp_replica_group"], "ep_replica_group": plan.meshes["ep_replica_group"],
            "num_layers": s["num_layers"], "tp_size": s["tp_size"], "ep_size": s["ep_size"],
            "B_attn": b // t.dp, "S_tkg": 1, "top_k": s["top_k"], "eps": s["eps"], "hidden_actual": s["hidden_actual"],
            "softmax_scale": s["softmax_scale"], "gate_clamp_upper_limit": s["gate_clamp_upper_limit"],
            "up_clamp_upper_limit": s["up_clamp_upper_limit"], "up_clamp_lower_limit": s["up_clamp_lower_limit"]}


def tensor_names(sig: Signature) -> dict[str, str]:
    """Signature input -> kernel argument name (per-buffer K/V as the GK integration names them)."""
    table = DECODE_NAMES if sig.program == "decode" else TAIL_NAMES
    out = {}
    for i in sig.inputs:
        if i.kind == "kv_buffer":
            half, g = i.name.split("_cache_")
            out[i.name] = f"{half}_cache_buf_{g}"
        else:
            out[i.name] = table.get(i.name, i.name)
    return out


def _kernel(program: str):
    module, name = KERNELS[program]
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        raise GkError(f"the {program} kernel {module}.{name} is not importable: install the nki-library revision "
                      f"the recipe pins (compile.nki_library)") from None


def build(plan, sig: Signature, build_dir: Path) -> Path:
    """Trace one program's NKI kernel to HLO and compile it with neuronx-cc; returns the NEFF."""
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    from nki.collectives import ReplicaGroup

    from .programs import example_inputs

    kernel = _kernel(sig.program)
    names = tensor_names(sig)
    extra = kernel_arguments(plan, sig.program)
    for mesh_arg in ("tp_replica_group", "ep_replica_group"):
        if mesh_arg in extra:
            extra[mesh_arg] = ReplicaGroup(extra[mesh_arg])
    if "hop_meshes" in extra:
        extra["hop_meshes"] = tuple(ReplicaGroup(m) for m in extra["hop_meshes"])
    accepted = inspect.signature(kernel).parameters
    unknown = [n for n in list(names.values()) + list(extra) if n not in accepted]
    if unknown:
        raise GkError(f"the pinned {sig.program} kernel does not take {unknown[:6]}: pin an nki-library revision "
                      f"with the per-buffer GK decode (compile.nki_library)")
    device = xm.xla_device()
    tensors = {names[i.name]: a.to(device)
               for i, a in zip(sig.inputs, example_inputs(sig, max(plan.recipe.decode.batch_sizes)))}
    if sig.program == "decode":
        tensors["rank_id"] = torch.zeros(1, dtype=torch.int32, device=device)
    outs = kernel(**tensors, **extra)
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    work = workdir(build_dir)
    work.mkdir(parents=True, exist_ok=True)
    (Path(build_dir) / "compiled").mkdir(parents=True, exist_ok=True)
    (work / f"{sig.program}.hlo.pb").write_bytes(bytes(torch_xla._XLAC._get_xla_tensors_hlo_proto(outs)))
    cmd = invocation(sig.program, plan.recipe, build_dir)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise GkError(f"neuronx-cc failed on the {sig.program} program (log: {cmd[-1].split('=', 1)[1]}): {last[0]}")
    return Path(build_dir) / "compiled" / f"{sig.program}.neff"
