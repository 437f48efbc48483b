"""The portable backend: torch.export of the twins, compiled by AOTInductor into ``.pt2`` packages.

One package a program (decode, tail) with a dynamic batch dimension covering the recipe's batch
sizes. Weights are graph inputs, so a package holds code only and every engine shares the shard
files. The decode package writes the new token's K/V into the KV buffers it is given, in place
(AOTInductor keeps the exported program's input mutations).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch

from ..errors import GkError
from .programs import example_inputs
from .signature import Signature

NAME = "torch-aotinductor"


def compiler() -> dict:
    return {"name": NAME, "version": torch.__version__}


def flags(target: str, batch_sizes: list[int]) -> list[str]:
    return [f"--device={_device(target)}", f"--dynamic-batch={min(batch_sizes)}..{max(batch_sizes)}",
            "--package=pt2"]


def _device(target: str) -> str:
    return "cuda" if target == "cuda" else "cpu"


def available(target: str) -> str | None:
    """None when this machine can compile for ``target``, else why not."""
    if target == "cuda" and not torch.cuda.is_available():
        return "CUDA is not available on this machine (the cuda target compiles where a GPU is)"
    return None


def build(program: torch.nn.Module, sig: Signature, batch_sizes: list[int], target: str, out: Path) -> None:
    """Export ``program`` over ``sig`` and compile it to the package ``out`` (atomically)."""
    device = _device(target)
    args = [a.to(device) for a in example_inputs(sig, max(batch_sizes))]
    batch = torch.export.Dim("batch", min=max(1, min(batch_sizes)), max=max(batch_sizes))
    dynamic = {"args": tuple({d: batch for d, s in enumerate(i.shape) if s == "batch"} or None for i in sig.inputs)}
    try:
        with warnings.catch_warnings():  # torch's own deprecation chatter while tracing
            warnings.simplefilter("ignore", FutureWarning)
            exported = torch.export.export(program.to(device), tuple(args), dynamic_shapes=dynamic, strict=False)
    except Exception as e:  # noqa: BLE001 - a trace failure is the build's error, said in one line
        raise GkError(f"torch.export of the {sig.program} program failed: {type(e).__name__}: "
                      f"{str(e).splitlines()[0] if str(e) else ''}") from e
    tmp = out.with_name(f".{out.stem}.{os.getpid()}.partial.pt2")  # aoti wants a .pt2 name
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            torch._inductor.aoti_compile_and_package(exported, package_path=str(tmp))
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
