"""The portable backend: torch.export of the twins, compiled by AOTInductor into ``.pt2`` packages.

One package a program (decode, tail) with a dynamic batch dimension covering the recipe's batch
sizes. Weights are graph inputs, so a package holds code only and every engine shares the shard
files. The decode package writes the new token's K/V into the KV buffers it is given, in place
(AOTInductor keeps the exported program's input mutations).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import shutil
import tempfile
import warnings
from importlib import metadata
from pathlib import Path

from ..errors import GkError, shown
from .signature import Signature

NAME = "torch-aotinductor"


def compiler() -> dict:
    """The compiler's name and version (torch's, read from its package metadata: planning a compile
    key does not import torch)."""
    return {"name": NAME, "version": metadata.version("torch")}


# What a program's C++ is compiled for. Inductor's default is the compiling host: -march=native
# (pytorch/pytorch@cf30153c4c131c8164ee7798e5022d810682e2cb:torch/_inductor/cpp_builder.py:998,
# _get_cpu_arch_cflags) and the widest vector ISA it has (torch/_inductor/cpu_vec_isa.py:649,
# pick_vec_isa, when config.cpp.simdlen is None). A program the compile cache or a farm hands to another
# host could then fault there (compiled on an AVX-512 farm worker, run on an AVX2 build host). On x86-64
# every program is compiled for x86-64-v3 with 256-bit (AVX2) vectors: config.cpp.march and
# config.cpp.simdlen (torch/_inductor/config.py:1697, 1687). Elsewhere the defaults stay and the host's
# CPU features join the flags, so a cached program only goes to a host like the one that compiled it.
PORTABLE = {"x86_64": ("x86-64-v3", 256)}  # machine -> (-march, vector bits)
X86_64_V3 = ("avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave")  # /proc/cpuinfo names


def cpu_features() -> set[str]:
    """This host's CPU feature names (/proc/cpuinfo's 'flags' on x86, 'Features' on ARM); empty where unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return set(value.split())
    except OSError:
        pass
    return set()


def code_target() -> dict:
    """{"machine", "march", and "simdlen" (pinned) or "cpu" (a digest of the host's features)}."""
    machine = platform.machine()
    if machine in PORTABLE:
        march, bits = PORTABLE[machine]
        return {"machine": machine, "march": march, "simdlen": bits}
    digest = hashlib.sha256(" ".join(sorted(cpu_features())).encode()).hexdigest()[:16]
    return {"machine": machine, "march": "native", "cpu": digest}


def flags(target: str, batch_sizes: list[int]) -> list[str]:
    """What the compile is told; ``--cpp-dynamic-threads``: the generated kernels take the thread
    count at run time rather than baking in the compiling process's (so a program's bytes do not
    depend on the host's cores, ``OMP_NUM_THREADS`` or a Ray worker's CPU share). The rest name the
    code target (``code_target``), which is part of the compile key."""
    return [f"--device={_device(target)}", f"--dynamic-batch={min(batch_sizes)}..{max(batch_sizes)}",
            "--package=pt2", "--cpp-dynamic-threads", *(f"--{k}={v}" for k, v in code_target().items())]


def _device(target: str) -> str:
    return "cuda" if target == "cuda" else "cpu"


def cannot_run(t: dict) -> str | None:
    """Why this host cannot run code compiled for code target ``t`` (``code_target``), or None."""
    here = platform.machine()
    if t.get("machine", here) != here:
        return f"compiled for {shown(t['machine'])}, and this host is {here}"
    have = cpu_features()
    missing = [f for f in X86_64_V3 if f not in have] if t.get("march") == "x86-64-v3" and have else []
    if missing:
        return f"compiled for x86-64-v3 (AVX2, FMA, BMI2), and this CPU lacks {', '.join(missing)}"
    if "cpu" in t and t["cpu"] != code_target().get("cpu"):
        return "compiled with -march=native on a CPU with other features"
    return None


# torch warns at every load of a package whose recorded ISA is not the host's widest
# (pytorch/pytorch@cf30153c4c131c8164ee7798e5022d810682e2cb:torch/export/pt2_archive/_package.py:1059,
# _load_aoti: "Device information mismatch for %s: %s vs %s", logger torch.export.pt2_archive._package).
# For a portable program on a wider CPU that is the point of the target, not a problem.
LOAD_LOGGER = "torch.export.pt2_archive._package"
PORTABLE_ISA = {256: "AVX2"}  # the AOTI_CPU_ISA a portable program records, by vector bits


def expected_mismatch(t: dict) -> str | None:
    """The AOTI_CPU_ISA a program of code target ``t`` records when that differs from this host's
    by design (portable, on a wider CPU), or None."""
    march, bits = PORTABLE.get(platform.machine(), (None, None))
    return PORTABLE_ISA.get(bits) if march is not None and t.get("march") == march else None


class _Expected(logging.Filter):
    def __init__(self, isa: str):
        super().__init__()
        self.isa = isa

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (record.msg.startswith("Device information mismatch") and len(args) == 3
                    and args[0] == "AOTI_CPU_ISA" and args[2] == self.isa)


@contextlib.contextmanager
def quiet_portable_load(t: dict):
    """Load a program of code target ``t`` without torch's ISA warning when the mismatch is the
    portable target's (``inspect`` says it once); any other mismatch stays loud."""
    isa = expected_mismatch(t)
    if isa is None:
        yield
        return
    f, log = _Expected(isa), logging.getLogger(LOAD_LOGGER)
    log.addFilter(f)
    try:
        yield
    finally:
        log.removeFilter(f)


def target_of(flags: list) -> dict:
    """The code target a program's recorded flags name (empty for a program built before they did)."""
    pairs = (f[2:].partition("=") for f in flags if isinstance(f, str) and f.startswith("--"))
    return {k: v for k, _, v in pairs if k in ("machine", "march", "cpu")}


def available(target: str) -> str | None:
    """None when this machine can compile for ``target``, else why not."""
    why = cannot_run(code_target())
    if why:
        return f"this host could not run what it compiles: {why}"
    if target != "cuda":
        return None
    import torch

    if not torch.cuda.is_available():
        return "CUDA is not available on this machine (the cuda target compiles where a GPU is)"
    return None


def build(program, sig: Signature, batch_sizes: list[int], target: str, out: Path, key: str) -> None:
    """Export ``program`` (a ``torch.nn.Module``) over ``sig`` and compile it to the package ``out``
    (atomically). ``key``: the program's compile key, which names its compile folder."""
    import torch

    from .programs import example_inputs

    device = _device(target)
    args = [a.to(device) for a in example_inputs(sig, max(batch_sizes))]
    lo, hi = max(1, min(batch_sizes)), max(batch_sizes)
    dynamic = None  # one batch size: a static program (torch.export refuses a Dim with min == max)
    if lo < hi:
        batch = torch.export.Dim("batch", min=lo, max=hi)
        dynamic = {"args": tuple({d: batch for d, s in enumerate(i.shape) if s == "batch"} or None
                                 for i in sig.inputs)}
    try:
        with warnings.catch_warnings():  # torch's own deprecation chatter while tracing
            warnings.simplefilter("ignore", FutureWarning)
            exported = torch.export.export(program.to(device), tuple(args), dynamic_shapes=dynamic, strict=False)
    except Exception as e:  # noqa: BLE001 - a trace failure is the build's error, said in one line
        raise GkError(f"torch.export of the {sig.program} program failed: {type(e).__name__}: "
                      f"{str(e).splitlines()[0] if str(e) else ''}") from e
    # Compiled in a private folder (so the archive's root is the program's name, never a temp
    # name), then rewritten without machine paths, and renamed into place when complete.
    tmp = out.parent / f".tmp-compile-{os.getpid()}"
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp.mkdir()
        staged = tmp / "staged" / f"{out.stem}.pt2"
        staged.parent.mkdir()
        with warnings.catch_warnings(), fixed_cache(key) as cache, \
                torch._inductor.config.patch({"aot_inductor.enable_line_tables": False,
                                               "cpp.dynamic_threads": True, **_pinned()}):
            warnings.simplefilter("ignore", FutureWarning)
            torch._inductor.aoti_compile_and_package(exported, package_path=str(staged))
            normalize(staged, tmp / f"{out.stem}.pt2", cache)
        os.replace(tmp / f"{out.stem}.pt2", out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _pinned() -> dict:
    """The inductor config that compiles for ``code_target`` (nothing to set where it is the host)."""
    t = code_target()
    return {"cpp.march": t["march"], "cpp.simdlen": t["simdlen"]} if "simdlen" in t else {}


# Records the archive writer adds itself (from the content, so they are deterministic too).
_WRITER_RECORDS = {"version", ".data/version", "byteorder", ".data/serialization_id"}
_TEXT = (".cpp", ".h", ".json", ".txt")


def cache_folder(key: str) -> Path:
    """Where the program of compile key ``key`` is always compiled: ``$TMPDIR/gkbuild-pt2-<uid>/<key[:16]>``
    (not the single ``gkbuild-aoti-<uid>`` folder of gkbuild 0.1, which an older gkbuild on the host empties)."""
    return Path(tempfile.gettempdir()) / f"gkbuild-pt2-{os.getuid()}" / key[:16]


@contextlib.contextmanager
def fixed_cache(key: str):
    """Inductor's cache folder for one program: a path fixed by the program's compile key, emptied
    first, held under that program's lock. g++ records the path of every source it compiles in the
    ``.so`` (its symbol table) and inductor hashes kernel sources that name it, so a path that
    varies (a fresh ``$TORCHINDUCTOR_CACHE_DIR``, another user's ``/tmp/torchinductor_<user>``)
    varies the bytes. One program always compiles at the same path (its archives are
    byte-identical); different programs compile at once (one lock a key, not one a user)."""
    from ..paths import file_lock

    root = cache_folder(key)
    base = root.parent
    base.mkdir(mode=0o700, exist_ok=True)
    if os.path.islink(base) or base.stat().st_uid != os.getuid():
        raise GkError(f"{base}: is a symlink or not ours; refusing to compile through it")
    with file_lock(base / f"{root.name}.lock"):
        if os.path.islink(root):
            raise GkError(f"{root}: is a symlink; refusing to compile through it")
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(mode=0o700)
        old = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root)
        try:
            yield str(root)
        finally:
            if old is None:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = old
            shutil.rmtree(root, ignore_errors=True)


def normalize(src: Path, dst: Path, cache: str) -> None:
    """``src`` rewritten as ``dst`` with nothing of the machine it was compiled on: the archive's
    root folder is ``dst``'s stem, and the inductor cache folders (``cache``, and the per-user
    ``/tmp/torchinductor_<user>`` of its precompiled headers), which AOTInductor writes into the
    generated sources' comments, read ``<inductor-cache>``. Records keep their order; the zip
    writer stamps no times."""
    import zipfile

    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    from torch.export.pt2_archive._package import PT2ArchiveWriter

    prefixes = sorted({cache, default_cache_dir()}, key=len, reverse=True)
    with zipfile.ZipFile(src) as z, PT2ArchiveWriter(str(dst)) as w:
        for name in z.namelist():
            rel = name.split("/", 1)[1]
            if rel in _WRITER_RECORDS:
                continue
            data = z.read(name)
            if rel.endswith(_TEXT):
                for p in prefixes:
                    data = data.replace(p.encode(), b"<inductor-cache>")
            w.write_bytes(rel, data)
