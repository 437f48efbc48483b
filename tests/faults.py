"""A catalogue of model-changing faults, each applied to what a build is made from: a copy of the
checkpoint (an edited tensor) or, for faults that only a build can have, the layout step that
makes the shard (patched while the build runs). Used by tests/test_verify_faults.py and
bench/bench_faults.py.

Each fault names the layer it changes. ``reference_edit`` is the checkpoint edit with the same
effect on the model (None where the model has no such thing, e.g. pad lanes), so the fault's size
can be measured in the reference itself.
"""

from __future__ import annotations

import contextlib
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import ml_dtypes
import numpy as np

from gkbuild.checkpoint.reader import Checkpoint
from gkbuild.layout import attention, experts_mx, hidden

BF16 = np.dtype(ml_dtypes.bfloat16)
Edit = dict[str, Callable[[np.ndarray], np.ndarray]]  # tensor name -> new value from the old


@dataclass
class Fault:
    name: str
    layer: int | None  # None: after the last layer (the tail)
    edit: Edit | None = None  # applied to a checkpoint copy
    patch: Callable | None = None  # (monkeypatch) -> None, active while the build runs
    reference_edit: Edit | None = None  # the same fault as a checkpoint edit (None: no HF equivalent)
    culprit: str | None = None  # how verify names it (default "layer N")

    def __post_init__(self):
        if self.edit is not None and self.reference_edit is None:
            self.reference_edit = self.edit
        if self.culprit is None:
            self.culprit = f"layer {self.layer}"


def edit_copy(src: Path, dst: Path, edit: Edit) -> Path:
    """A copy of checkpoint ``src`` at ``dst`` with tensors changed in place (same header)."""
    shutil.copytree(src, dst)
    ck = Checkpoint.open(dst)
    try:
        for name, fn in edit.items():
            info = ck.info(name)
            old = np.array(ck.read(name))
            new = np.ascontiguousarray(fn(old.copy()), dtype=old.dtype)
            assert new.shape == old.shape and not np.array_equal(new.view(np.uint8), old.view(np.uint8)), name
            with open(info.file, "r+b") as f:
                f.seek(info.offset)
                f.write(new.tobytes())
    finally:
        ck.close()
    return dst


def _f32(fn):
    """An edit written in float32 on a bf16 tensor."""
    return lambda a: fn(a.astype(np.float32)).astype(a.dtype)


def _set(a: np.ndarray, index, value) -> np.ndarray:
    a[index] = value
    return a


def _swap(a: np.ndarray, i, j) -> np.ndarray:
    a[[i, j]] = a[[j, i]]
    return a


def nth_call(monkeypatch, module, name: str, n: int, change) -> None:
    """Change the n-th call (1-based) of a layout function: a world-size-1 build makes its layers
    in order, so the n-th call is layer n-1."""
    orig, calls = getattr(module, name), {"n": 0}

    def wrapped(*a, **kw):
        out = orig(*a, **kw)
        calls["n"] += 1
        return change(out, *a, **kw) if calls["n"] == n else out

    monkeypatch.setattr(module, name, wrapped)


def dirty_pads(monkeypatch) -> None:
    orig = hidden.to_kernel

    def dirty(x, axis, Hp):
        out = orig(x, axis, Hp)
        lanes = np.moveaxis(out, axis, 0)
        # 0.5 in every float form: a build moves bf16 as its uint16 bits (0x3F00 is bf16 0.5; an MX
        # tile's uint16 lanes are as dirty with it as with 1)
        dirt = 0x3F00 if out.dtype == np.uint16 else 1 if out.dtype.kind in "ui" else 0.5
        lanes[hidden.sigma(Hp) >= x.shape[axis]] = dirt
        return out

    monkeypatch.setattr(hidden, "to_kernel", dirty)


def _wrong_v_scale(monkeypatch, layer: int, factor: float) -> None:
    orig = attention.w_out
    calls = {"n": 0}

    def wrapped(dims, t, o_w, v_scale=1.0):
        calls["n"] += 1
        return orig(dims, t, o_w, v_scale * (factor if calls["n"] == layer + 1 else 1.0))

    monkeypatch.setattr(attention, "w_out", wrapped)


def drop_up_shift(monkeypatch, layer: int) -> None:
    def drop(B, *a, **kw):
        B = B.copy()
        B[:, :, 1] -= experts_mx.UP_BIAS_SHIFT
        return B

    nth_call(monkeypatch, experts_mx, "gate_up_bias", layer + 1, drop)


def unused_expert_fault(layer: int, expert: int) -> Fault:
    """An expert no prompt of the golden routes to, its MXFP4 scales doubled (every scale byte
    +1): invisible in the logits of those prompts, a 2x expert for any other."""
    name = f"model.layers.{layer}.mlp.experts.gate_up_proj_scales"
    return Fault(f"scales of unused expert {expert} doubled (layer {layer})", layer,
                 {name: lambda a: _set(a, expert, a[expert] + 1)}, culprit=f"layer {layer} (experts {expert})")


def catalogue(cfg, kth_expert: int, router_shift: float = 0.15) -> list[Fault]:
    """The faults, for a checkpoint of config ``cfg`` (gkbuild.model.GptOssConfig).
    ``kth_expert``: an expert of layer 1 that tokens choose last (at the k-th place), so that
    lowering its router bias by ``router_shift`` moves some of them. (``unused_expert_fault``
    needs a checkpoint with experts the golden leaves unrouted: more experts than tiny's 8.)"""
    d = cfg.d
    p0, p1 = "model.layers.0.", "model.layers.1."
    q_swap = {p1 + "self_attn.q_proj." + n: (lambda a: _swap(a.reshape(cfg.q_heads, d, -1), 0, 1).reshape(a.shape))
              for n in ("weight", "bias")}
    expert_swap = {p1 + "mlp.experts." + n: (lambda a: _swap(a, 0, 1))
                   for n in ("gate_up_proj_blocks", "gate_up_proj_scales", "gate_up_proj_bias", "down_proj_blocks",
                             "down_proj_scales", "down_proj_bias")}
    head = slice(2 * d, 3 * d)
    return [
        Fault("negated sink (layer 0, head 0)", 0, {p0 + "self_attn.sinks": _f32(lambda a: _set(a, 0, -a[0]))}),
        Fault(f"router bias -{router_shift} (layer 1, expert {kth_expert})", 1,
              {p1 + "mlp.router.bias": _f32(lambda a: _set(a, kth_expert, a[kth_expert] - router_shift))}),
        Fault("experts 0 and 1 swapped (layer 1)", 1, expert_swap),
        Fault("q heads 0 and 1 swapped (layer 1)", 1, q_swap),
        Fault("W_out rows of head 2 permuted (layer 1)", 1,
              {p1 + "self_attn.o_proj.weight": lambda a: _set(a, (slice(None), head), a[:, head][:, ::-1])}),
        Fault("v_scale folded x1.25 (layer 1)", 1, patch=lambda mp: _wrong_v_scale(mp, 1, 1.25),
              reference_edit={p1 + "self_attn.o_proj.weight": _f32(lambda a: a * 1.25)}),
        Fault("+1 up-bias fold missing (layer 1)", 1, patch=lambda mp: drop_up_shift(mp, 1),
              reference_edit={p1 + "mlp.experts.gate_up_proj_bias": _f32(lambda a: _set(a, (slice(None), slice(1, None, 2)),
                                                                                       a[:, 1::2] - 1))}),
        Fault("pad lanes nonzero", 0, patch=dirty_pads),
        # small at layer 0 (~0.007 of the hidden state, under LAYER_TOL) and amplified by layer 1
        # (~0.07): the first layer to depart is named, not the first above a fixed limit
        Fault("o_proj x1.01 (layer 0)", 0, {p0 + "self_attn.o_proj.weight": _f32(lambda a: a * 1.01)}),
        Fault("final norm x1.01", None, {"model.norm.weight": _f32(lambda a: a * 1.01)}, culprit="the final norm"),
        Fault("lm_head rows of one vocab slice x1.01", None,
              {"lm_head.weight": _f32(lambda a: _set(a, slice(0, cfg.V // 8), a[:cfg.V // 8] * 1.01))},
              culprit="the lm_head"),
    ]


@contextlib.contextmanager
def patched(fault: Fault):
    """The fault's build-time patch, active inside the block."""
    import pytest

    mp = pytest.MonkeyPatch()
    try:
        if fault.patch:
            fault.patch(mp)
        yield
    finally:
        mp.undo()


def unused_experts(golden, layer: int) -> list[int]:
    """The experts of ``layer`` no sequence of the golden routes to, at any position."""
    used = set(golden.routing[:, layer].reshape(-1).tolist())
    return [e for e in range(golden.expert_outputs.shape[1]) if e not in used]


def kth_expert(golden, layer: int = 1, below: float = 0.15) -> int:
    """The expert most often chosen last (k-th) where the reference's margin is under ``below``."""
    near = golden.router_gap[:, layer] < below
    last = golden.routing[:, layer, :, -1][near]
    return int(np.bincount(last.numpy()).argmax()) if len(last) else int(golden.routing[0, layer, 0, -1])
