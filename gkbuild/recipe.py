"""``recipe.yaml``: what to build, from which checkpoint, for which machine and topology.

The schema is the dataclasses below: each field's type, default, allowed values and doc line are
declared once and drive loading, validation, typo suggestions and ``gkbuild recipe-doc``. A recipe
is validated in two steps: on its own (``load``), then against the model it builds
(``check_against``), before any weight is read.
"""

from __future__ import annotations

import dataclasses
import difflib
import collections
import hashlib
import json
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .errors import GkError, shown
from .jsonio import MAX_DEPTH, open_regular
from .layout.tail import batch_groups_refusal
from .layout.dims import MX_TILE, pad_to
from .layout.kv import FORMS as KV_FORMS
from .model import FULL, SLIDING, GptOssConfig

TARGETS = ("trn2", "trn3", "cpu", "cuda")
NEURON_TARGETS = ("trn2", "trn3")
_ENTRY_POINT = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*$")
_SWITCH = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=.*$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
EMBEDDINGS = ("host", "vocab", "hidden")
# Values a recipe may still carry from an earlier gkbuild, and why they are gone.
RETIRED_KEYS = {"compile.nki_library": "replaced by compile.kernels.decode.library and compile.kernels.tail.library "
                                       "(each program names its own library@commit)"}
RETIRED = {("kv_cache.form", "per_buffer"): "per_buffer is seed 000's unpublished fork: no published kernel takes "
                                            "per-buffer K/V arguments; use paired (the same layer pairs, stacked "
                                            "[ceil(L/2), ...], kernel F)"}
ROPE_MODES = ("host", "fused")
# HBM a rank holds back for what is not a tensor of the plan: the decode and tail NEFFs (instruction
# streams and DMA descriptors of 36 unrolled layers), their HBM scratch (collective staging, gathered
# activations) and the Neuron runtime's own per-core allocations. An estimate, not a measurement:
# replace it with what neuron-monitor reports for the compiled programs on a Trainium host.
DEFAULT_DEVICE_RESERVE_GIB = 1.0
MAX_BATCH_SIZES = 64  # decode batch sizes a recipe builds for: one NEFF each on trn
MAX_BATCH = 1 << 16  # a global decode batch (the 120b's production batch is 128 to 1024)


def _f(default, doc: str, choices: tuple | None = None, **kw):
    meta = {"doc": doc, "choices": choices}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


@dataclass
class Topology:
    tp: int = _f(1, "tensor-parallel degree of attention (heads split over tp ranks)")
    dp: int = _f(1, "data-parallel replicas of attention; world size = tp * dp")
    ep: int = _f(1, "expert-parallel degree; the EP group spans every rank, so ep = tp * dp")
    lnc: int = _f(1, "logical NeuronCore size; the GK decode is an LNC=1 kernel", (1,))
    vtp: int = _f(1, "vocab-parallel degree of the sampling tail (lm_head split over every rank: tp * dp)")
    hops: list = _f([], "all-to-all hop sizes of the tail, multiplying to vtp (default: [vtp])")
    a2a_batch_groups: int = _f(1, "split the tail exchange into this many batch groups (single hop only)")

    @property
    def world(self) -> int:
        return self.tp * self.dp


@dataclass
class KVCache:
    dtype: str = _f("bf16", "KV element type", ("bf16", "fp8"))
    form: str = _f("stacked", "stacked: K and V tensors [L, ...], a layer an entry (kernels A and F); paired: "
                              "[ceil(L/2), ...], layers 2j and 2j+1 share entry j with disjoint blocks (kernel F)",
                   KV_FORMS)
    packed: bool = _f(False, "packed FP8 K: [blocks, kv, block/2, d, 2] (two tokens per 16-bit lane)")
    block_size: int = _f(128, "tokens per KV block")
    num_blocks: typing.Optional[int] = _f(None, "blocks per buffer; or give hbm_per_rank_gib + memory_utilization")
    hbm_per_rank_gib: typing.Optional[float] = _f(None, "device memory per rank, GiB (budget mode)")
    memory_utilization: typing.Optional[float] = _f(None, "fraction of hbm_per_rank_gib usable (budget mode)")
    device_reserve_gib: float = _f(DEFAULT_DEVICE_RESERVE_GIB, "device memory per rank held back for the compiled "
                                   "programs and their scratch, GiB: it comes out of what memory_utilization leaves "
                                   "free, else out of the KV")
    k_scale: float = _f(1.0, "FP8 K dequant scale (K = stored * k_scale), 2^-24..2^24; folded into softmax_scale")
    v_scale: float = _f(1.0, "FP8 V dequant scale (V = stored * v_scale), 2^-24..2^24; folded into W_out")


@dataclass
class Decode:
    batch_sizes: list = _f([1], f"global decode batch sizes to build for (each a multiple of tp * dp, each once, "
                                f"at most {MAX_BATCH_SIZES})")
    max_context: int = _f(4096, "longest sequence a step attends to: the full block table's width in tokens")
    embedding: str = _f("host", "where tokens are embedded: host (the runtime, from a host-side table), vocab "
                                "(the kernel's fused prologue, V/W x Hp a rank) or hidden (V x Hp/TP a TP rank)",
                        EMBEDDINGS)
    rope: str = _f("host", "RoPE: host (the runtime passes cos/sin) or fused (the kernel takes inv_freq, d/2 x 1 "
                           "fp32, and rope_concentration)", ROPE_MODES)


@dataclass
class Tail:
    k: int = _f(256, "top-k candidates the tail keeps")
    emit_logits: bool = _f(True, "also return the fp32 pre-collective logits (debug/gating output)")
    runtime_draw: bool = _f(False, "sampling_params carry a 4th column, the per-row draw u (else the compiled-in 0.5)")


@dataclass
class DecodeKernel:
    library: typing.Optional[str] = _f(None, "OWNER/REPO@COMMIT, URL@COMMIT or a folder; default: aws-neuron/"
                                             "nki-library@e9ef98fc, or the fork baonudesifeizhai/nki-library@9f2490f6 "
                                             "when a form needs it (paired KV, fused embedding or RoPE)")
    entry: typing.Optional[str] = _f(None, "module:function; default: nkilib.models.gpt_oss.c128_giga_kernel."
                                           "experimental.gpt_oss.gpt_oss_decode_layer_dp_tp_ep:gpt_oss_decode_mega_kernel")


@dataclass
class TailKernel:
    library: typing.Optional[str] = _f(None, "OWNER/REPO@COMMIT, URL@COMMIT or a folder; default: "
                                             "baonudesifeizhai/nki-library@9f2490f6 (no aws-neuron commit holds it)")
    entry: typing.Optional[str] = _f(None, "module:function; default: nkilib.experimental.gpt_oss_tail."
                                           "tail_chunked_megakernel:gpt_oss_tail_chunked_megakernel")


@dataclass
class Kernels:
    decode: DecodeKernel = _f(None, "the GK decode kernel")
    tail: TailKernel = _f(None, "the sampling-tail kernel")


@dataclass
class Compile:
    optimization_level: int = _f(2, "neuronx-cc optimization level", (1, 2, 3))
    kernels: Kernels = _f(None, "the kernels each Neuron program compiles, each from its own library@commit")
    kernel_switches: list = _f([], "NAME=VALUE settings of the kernel's VLLM_NEURON_MEGA_* switches; every switch "
                                   "the revision reads is set explicitly, these override gkbuild's reference path "
                                   "(KV write-back on, the rest off); `gkbuild recipe-doc` lists them")
    trace: str = _f("host", "host: torch_neuronx.trace(cpu_backend=True) with NEURON_PLATFORM_TARGET_OVERRIDE, no "
                            "NeuronCore needed (AWS-documented); device: torch_neuronx.trace on a NeuronCore; "
                            "xla-cpu: torch-xla on PJRT_DEVICE=CPU + the neuronx-cc CLI (undocumented, unverified)",
                    ("host", "device", "xla-cpu"))
    host_profile: typing.Optional[str] = _f(None, "a `gkbuild doctor` report (DIR/doctor.json, relative to the "
                                                  "recipe) whose answers the Neuron backend follows: MX carrier "
                                                  "dtype, K/V aliases, NEFF location, FP8 saturation; without one "
                                                  "the manifest says unchecked")
    job_cpus: typing.Optional[int] = _f(None, "CPUs a gkbuild farm job asks its cluster for, one program "
                                              "(default: 1 for cpu/cuda, 8 for trn2/trn3)")
    job_memory_gib: typing.Optional[float] = _f(None, "memory a gkbuild farm job asks its cluster for, in GiB "
                                                      "(default: 3 for cpu/cuda, 64 for trn2/trn3: a full-model "
                                                      "NEFF compile takes tens of GB)")


SCALE_RULES = ("round_up", "floor")  # gkbuild.checkpoint.quantize.RULES (numpy's: not imported by a recipe)
QUANTIZER_VERSION = 1  # bump when gkbuild.checkpoint.quantize's bytes change: it keys the expert shards


@dataclass
class Quantize:
    scale_rule: str = _f("round_up", "how a dense (bf16/fp32) source's experts become MXFP4: round_up (triton_kernels' "
                                     "downcast_to_mxfp, what transformers' MXFP4 integration calls) or floor (OCP MX "
                                     "v1.0, torchao's to_mx FLOOR); an MXFP4 source is read as published",
                         SCALE_RULES)


@dataclass
class Recipe:
    source: str = _f(None, "checkpoint: hf://ORG/NAME@REV, s3://BUCKET/PREFIX, synth://PRESET?layers=N&seed=S, or a folder")
    target: str = _f(None, "machine the artifacts are for", TARGETS)
    name: typing.Optional[str] = _f(None, "build name (default: the recipe file's stem)")
    topology: Topology = _f(None, "ranks and meshes")
    experts: str = _f("mxfp4", "expert weight format: MX tiles (fp4x4 in u16) or dequantized bf16", ("mxfp4", "bf16"))
    quantize: Quantize = _f(None, "quantizing a bf16/fp32 fine-tune's experts to MXFP4 as a stage of the build")
    kv_cache: KVCache = _f(None, "KV cache layout and budget")
    decode: Decode = _f(None, "decode step shapes")
    tail: Tail = _f(None, "sampling tail options")
    compile: Compile = _f(None, "compiler options")
    output: typing.Optional[str] = _f(None, "output folder (default: artifacts/<name>)")

    # filled in by load()
    path: typing.Optional[Path] = field(default=None, repr=False, compare=False)

    @property
    def fp8_format(self) -> str:
        """trn2 takes IEEE-style e4m3 (max 240); trn3 and the portable targets OCP e4m3fn (max 448)."""
        return "fp8_e4m3" if self.target == "trn2" else "fp8_e4m3fn"

    @property
    def kv_dtype(self) -> str:
        return self.fp8_format if self.kv_cache.dtype == "fp8" else "bf16"

    @property
    def hops(self) -> list[int]:
        return list(self.topology.hops) or [self.topology.vtp]

    @property
    def backend(self) -> str:
        return "neuron" if self.target in NEURON_TARGETS else "inductor"

    @property
    def job_resources(self) -> tuple[int, int]:
        """(CPUs, memory bytes) a farm job of this recipe asks its cluster for."""
        neuron = self.backend == "neuron"
        cpus = self.compile.job_cpus or (8 if neuron else 1)
        gib = self.compile.job_memory_gib or (64 if neuron else 3)
        return cpus, int(gib * (1 << 30))

    def output_dir(self, cwd: Path | None = None) -> Path:
        p = Path(self.output) if self.output else Path("artifacts") / self.name
        return p if p.is_absolute() else (cwd or Path.cwd()) / p

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("path")
        d["topology"]["hops"] = self.hops
        return d

    def digest(self) -> str:
        """sha256 of the resolved recipe (what the build depends on; the output path excluded)."""
        d = self.to_dict()
        d.pop("output")
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()

    # -- validation -----------------------------------------------------------------------------
    def validate(self) -> "Recipe":
        t, kv = self.topology, self.kv_cache
        where = self.path or "recipe"

        def bad(key: str, value, expected: str) -> typing.NoReturn:
            raise GkError(f"{where}: {key}: {shown(value)} is not valid; {expected}")

        if not _NAME.match(self.name or ""):
            bad("name", self.name, "a build name is a plain file name: letters, digits, '.', '_', '-', not "
                                   "starting with '.' (it names the folder under artifacts/)")
        for key, v in (("decode.max_context", self.decode.max_context),
                       ("topology.tp", t.tp), ("topology.dp", t.dp), ("topology.ep", t.ep),
                       ("topology.vtp", t.vtp), ("topology.a2a_batch_groups", t.a2a_batch_groups),
                       ("kv_cache.block_size", kv.block_size), ("tail.k", self.tail.k)):
            if v < 1:
                bad(key, v, "expected a positive integer")
        if t.ep != t.world:
            bad("topology.ep", t.ep, f"the EP group spans every rank, so ep must be tp * dp = {t.world}")
        if self.target not in NEURON_TARGETS and t.world != 1:
            bad("topology", f"tp {t.tp} x dp {t.dp}", f"{self.target} artifacts run on one device: tp = dp = ep = "
                                                       f"vtp = 1 (multi-rank topologies are for trn2/trn3)")
        if t.vtp != t.world:
            bad("topology.vtp", t.vtp, f"the tail runs on every rank, so vtp must be the world size {t.world}")
        hops = self.hops
        if any((not isinstance(h, int)) or h < 1 for h in hops):
            bad("topology.hops", hops, "expected a list of positive integers")
        if math.prod(hops) != t.vtp:
            bad("topology.hops", hops, f"hop sizes must multiply to vtp = {t.vtp}")
        if kv.packed and kv.dtype != "fp8":
            bad("kv_cache.packed", kv.packed, "packed K is an FP8 layout; set kv_cache.dtype: fp8")
        if kv.packed and kv.block_size % 2:
            bad("kv_cache.block_size", kv.block_size, "packed K pairs tokens, so the block size must be even")
        budget = (kv.hbm_per_rank_gib, kv.memory_utilization)
        if kv.num_blocks is not None:
            if kv.num_blocks < 1:
                bad("kv_cache.num_blocks", kv.num_blocks, "expected a positive integer")
            if any(b is not None for b in budget):
                bad("kv_cache.num_blocks", kv.num_blocks,
                    "give either num_blocks or hbm_per_rank_gib + memory_utilization, not both")
        elif None in budget:
            bad("kv_cache", "num_blocks missing", "give num_blocks, or hbm_per_rank_gib and memory_utilization")
        else:
            if kv.hbm_per_rank_gib <= 0:
                bad("kv_cache.hbm_per_rank_gib", kv.hbm_per_rank_gib, "expected a positive size in GiB")
            if not 0 < kv.memory_utilization <= 1:
                bad("kv_cache.memory_utilization", kv.memory_utilization, "expected a fraction in (0, 1]")
        if kv.device_reserve_gib < 0:
            bad("kv_cache.device_reserve_gib", kv.device_reserve_gib, "expected a size in GiB, 0 or more")
        if self.target not in NEURON_TARGETS:
            for key, v in (("decode.embedding", self.decode.embedding), ("decode.rope", self.decode.rope)):
                if v != "host":
                    bad(key, v, f"the {self.target} programs take the embedded x and cos/sin; use host "
                                f"(fused forms are the GK decode's, trn2/trn3)")
        for key, s in (("kv_cache.k_scale", kv.k_scale), ("kv_cache.v_scale", kv.v_scale)):
            if not SCALE_RANGE[0] <= s <= SCALE_RANGE[1]:
                bad(key, s, f"an FP8 dequant scale is in {SCALE_RANGE[0]:g}..{SCALE_RANGE[1]:g} (it is folded "
                            f"into bf16 weights and fp32 softmax scales)")
        self._validate_compile(bad)
        bs = self.decode.batch_sizes
        if not bs or any((not isinstance(b, int)) or isinstance(b, bool) or not 1 <= b <= MAX_BATCH for b in bs):
            bad("decode.batch_sizes", bs, f"expected a non-empty list of integers in 1..{MAX_BATCH}")
        if len(bs) > MAX_BATCH_SIZES:
            bad("decode.batch_sizes", bs, f"at most {MAX_BATCH_SIZES} batch sizes (on trn each is a program to "
                                          f"compile), not {len(bs)}")
        twice = next((b for b, n in collections.Counter(bs).items() if n > 1), None)
        if twice is not None:
            bad("decode.batch_sizes", twice, "each batch size once (this one is given more than once)")
        for b in bs:
            if b % t.world:
                bad("decode.batch_sizes", b, f"each batch size must be a multiple of tp * dp = {t.world} "
                                             f"(every rank holds at least one token)")
            if self.decode.embedding == "hidden" and b // t.dp > 128:
                bad("decode.batch_sizes", b, f"decode.embedding: hidden gathers a DP replica's {b // t.dp} tokens into "
                                             f"one SBUF tile of at most 128 rows (the fork F's prologue): use vocab or "
                                             f"host, or more DP replicas")
        return self

    def _validate_compile(self, bad) -> None:
        c = self.compile
        for program in ("decode", "tail"):
            entry = getattr(c.kernels, program).entry
            if entry is not None and not _ENTRY_POINT.match(entry):
                bad(f"compile.kernels.{program}.entry", entry, "expected module:function, e.g. nkilib.experimental."
                                                              "gpt_oss_tail.tail_chunked_megakernel:"
                                                              "gpt_oss_tail_chunked_megakernel")
        names = []
        for sw in c.kernel_switches:
            if not isinstance(sw, str) or not _SWITCH.match(sw) or not sw.startswith("VLLM_NEURON_MEGA_"):
                bad("compile.kernel_switches", sw, "expected VLLM_NEURON_MEGA_NAME=VALUE strings (the kernels' "
                                                   "trace-time switches)")
            names.append(sw.partition("=")[0])
        if len(set(names)) != len(names):
            bad("compile.kernel_switches", c.kernel_switches, "each switch once")
        if c.job_cpus is not None and c.job_cpus < 1:
            bad("compile.job_cpus", c.job_cpus, "expected a positive number of CPUs")
        if c.job_memory_gib is not None and not 0 < c.job_memory_gib <= 1 << 20:
            bad("compile.job_memory_gib", c.job_memory_gib, "expected a positive size in GiB")

    def check_against(self, cfg: GptOssConfig) -> "Recipe":
        """Reject a topology the model cannot be split into, naming the key and the valid values."""
        t = self.topology
        where = self.path or "recipe"

        def divisors(n: int) -> str:
            return ", ".join(str(i) for i in range(1, n + 1) if n % i == 0)

        if cfg.q_heads % t.tp:
            raise GkError(f"{where}: topology.tp: {t.tp} does not divide the {cfg.q_heads} attention heads; "
                          f"valid: {divisors(cfg.q_heads)}")
        if cfg.kv_heads % t.tp and t.tp % cfg.kv_heads:
            raise GkError(f"{where}: topology.tp: {t.tp} neither divides nor is a multiple of the "
                          f"{cfg.kv_heads} KV heads")
        hp = pad_to(cfg.H, MX_TILE)
        if self.decode.embedding == "hidden" and hp % t.tp:
            raise GkError(f"{where}: decode.embedding: hidden: tp {t.tp} does not divide the {hp} padded hidden "
                          f"lanes; use vocab or host")
        if cfg.E % t.ep:
            raise GkError(f"{where}: topology.ep: {t.ep} does not divide the {cfg.E} experts; "
                          f"valid: {divisors(cfg.E)}")
        if cfg.V % t.vtp:
            raise GkError(f"{where}: topology.vtp: {t.vtp} does not divide the vocabulary of {cfg.V}")
        if self.tail.k > cfg.V:
            raise GkError(f"{where}: tail.k: {self.tail.k} exceeds the vocabulary of {cfg.V}")
        if t.a2a_batch_groups > 1:
            for b in self.decode.batch_sizes:
                why = batch_groups_refusal(b, t.vtp, self.hops, t.a2a_batch_groups, cfg.V, self.tail.k)
                if why:
                    raise GkError(f"{where}: topology.a2a_batch_groups: {t.a2a_batch_groups} is refused by the tail "
                                  f"kernel at batch {b}: {why}")
        want = tuple(SLIDING if i % 2 == 0 else FULL for i in range(cfg.L))
        if cfg.layer_types != want:
            raise GkError(f"{where}: source: the GK decode bakes even = sliding, odd = full attention layers; "
                          f"this model's layer_types differ")
        return self


# -- loading ---------------------------------------------------------------------------------------
MAX_RECIPE = 1 << 20  # bytes; a recipe is a few hundred
# Upper bounds that keep anything allocated from a recipe sane (the real builds are far below).
LIMITS = {"decode.batch_sizes": 1 << 16, "decode.max_context": 1 << 24, "kv_cache.block_size": 1 << 16,
          "kv_cache.num_blocks": 1 << 30, "kv_cache.hbm_per_rank_gib": 1 << 16, "tail.k": 1 << 16,
          "topology.tp": 1 << 12, "topology.dp": 1 << 12, "topology.ep": 1 << 16, "topology.vtp": 1 << 16,
          "topology.hops": 1 << 16, "topology.a2a_batch_groups": 1 << 16, "kv_cache.device_reserve_gib": 1 << 16}
# FP8 dequant scales: far outside this, a fold overflows or flushes bf16 weights.
SCALE_RANGE = (2.0 ** -24, 2.0 ** 24)
INT_LISTS = ("topology.hops", "decode.batch_sizes")
MAX_NODES = 4096  # YAML values in a recipe (or a --set / --vary value)


class _Loader(yaml.SafeLoader):
    """YAML without aliases (a few bytes of ``&a [*b, *b, ...]`` expand to gigabytes), nested at
    most ``jsonio.MAX_DEPTH`` deep (the composer recurses a level a node), of at most ``MAX_NODES``
    values (a recipe holds a few dozen; 100,000 list items took seconds to parse, then to plan),
    and without duplicate keys (the last one would win silently)."""

    depth = nodes = 0

    def compose_node(self, parent, index):
        ev = self.peek_event()
        if isinstance(ev, yaml.AliasEvent):
            raise GkError(f"line {ev.start_mark.line + 1}: YAML aliases (*{ev.anchor[:40]}) are not "
                          f"allowed in a recipe")
        if self.depth >= MAX_DEPTH:
            raise GkError(f"line {ev.start_mark.line + 1}: nested deeper than {MAX_DEPTH} levels")
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise GkError(f"line {ev.start_mark.line + 1}: more than {MAX_NODES} values; a recipe holds a few dozen")
        self.depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_mapping(self, node, deep=False):
        seen = set()
        for k, _ in node.value:
            key = self.construct_object(k, deep=True)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise GkError(f"line {k.start_mark.line + 1}: key {shown(key)} is given twice")
            seen.add(key) if isinstance(key, (str, int, float, bool)) else None
        return super().construct_mapping(node, deep)


def parse_yaml(text: str, where) -> object:
    """Recipe YAML (or a ``--set`` value): no aliases, no duplicate keys."""
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except GkError as e:
        raise GkError(f"{where}: {e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark else ""
        raise GkError(f"{where}: not valid YAML{at}") from None


def _fields(cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls) if f.name != "path"}


def _hint_base(hint):
    """(base type, optional?) of a field annotation."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0], True
    return hint, False


def _coerce(value, hint, key: str, where, choices):
    base, optional = _hint_base(hint)
    if value is None:
        if optional:
            return None
        raise GkError(f"{where}: {key}: a value is required")
    ok = {
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        bool: isinstance(value, bool),
        str: isinstance(value, str),
        list: isinstance(value, list),
    }.get(base)
    if not ok:
        raise GkError(f"{where}: {key}: expected {base.__name__}, got {type(value).__name__} {shown(value)}")
    if base is float and not math.isfinite(value):
        raise GkError(f"{where}: {key}: {value!r} is not a finite number")
    if choices and value not in choices:
        if (key, value) in RETIRED:
            raise GkError(f"{where}: {key}: {RETIRED[key, value]}")
        raise GkError(f"{where}: {key}: {shown(value)} is not one of {', '.join(map(str, choices))}")
    if key in INT_LISTS and any(isinstance(v, bool) or not isinstance(v, int) for v in value):
        raise GkError(f"{where}: {key}: expected a list of integers, got {shown(value)}")
    if base is str and len(value) > 4096:
        raise GkError(f"{where}: {key}: a string of {len(value)} characters is too long")
    limit = LIMITS.get(key)
    if limit is not None and any(v > limit for v in (value if base is list else [value])):
        raise GkError(f"{where}: {key}: {shown(value)} exceeds the limit of {limit}")
    return float(value) if base is float else value


def _build(cls, data, prefix: str, where):
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise GkError(f"{where}: {prefix.rstrip('.') or 'recipe'}: expected a mapping, got {type(data).__name__}")
    fields = _fields(cls)
    hints = typing.get_type_hints(cls)
    for key in data:
        if f"{prefix}{key}" in RETIRED_KEYS:
            raise GkError(f"{where}: {prefix}{key}: {RETIRED_KEYS[prefix + key]}")
        if key not in fields:
            near = difflib.get_close_matches(str(key)[:100], fields, n=1, cutoff=0.6)
            full = f"{prefix}{str(key)[:100]}"
            hint = f" (did you mean '{prefix}{near[0]}'?)" if near else ""
            raise GkError(f"{where}: unknown key '{full}'{hint}; valid keys here: {', '.join(fields)}")
    kwargs = {}
    for name, f in fields.items():
        hint = hints[name]
        key = prefix + name
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, data.get(name), key + ".", where)
        elif name in data:
            kwargs[name] = _coerce(data[name], hint, key, where, f.metadata.get("choices"))
        elif f.default is None and f.default_factory is dataclasses.MISSING and not _hint_base(hint)[1]:
            raise GkError(f"{where}: missing required key '{key}'")
    return cls(**kwargs)


def from_dict(data: dict, where="recipe", path: Path | None = None) -> Recipe:
    r = _build(Recipe, data, "", where)
    r.path = path
    if r.name is None:
        r.name = path.stem if path else "build"
    return r.validate()


def apply_overrides(data: dict, overrides: list[str], where) -> dict:
    """``key.path=value`` assignments (value parsed as YAML) on top of a recipe mapping."""
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise GkError(f"{where}: --set {item!r}: expected KEY=VALUE, e.g. kv_cache.dtype=bf16")
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise GkError(f"{where}: --set {key}: '{part}' is not a mapping")
            node = nxt
        node[parts[-1]] = parse_yaml(value, f"{where}: --set {shown(item)}")
    return data


def load(path: Path | str, overrides: list[str] = ()) -> Recipe:
    path = Path(path)
    return loads(read_text(path), path, overrides)


def read_text(path: Path) -> str:
    """A recipe file's text: at most ``MAX_RECIPE`` bytes of UTF-8."""
    try:
        if path.is_dir():
            raise GkError(f"{path}: is a folder, not a recipe file")
        with open_regular(path) as f:
            raw = f.read(MAX_RECIPE + 1)
    except FileNotFoundError:
        raise GkError(f"{path}: recipe not found") from None
    if len(raw) > MAX_RECIPE:
        raise GkError(f"{path}: over {MAX_RECIPE} bytes; not a recipe")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise GkError(f"{path}: not UTF-8 text (byte {e.start})") from None
    return text


def loads(text: str, path: Path, overrides: list[str] = ()) -> Recipe:
    """A recipe from its text; ``path`` names it in errors and anchors its relative paths."""
    data = parse_yaml(text, path)
    if overrides:
        if not isinstance(data, dict):
            raise GkError(f"{path}: recipe: expected a mapping")
        data = apply_overrides(data, list(overrides), path)
    return from_dict(data, where=path, path=path)


def schema_doc() -> list[tuple[str, str, str]]:
    """(key, default/choices, doc) rows for every recipe key: the README table and ``recipe-doc``."""
    rows = []

    def walk(cls, prefix):
        hints = typing.get_type_hints(cls)
        for name, f in _fields(cls).items():
            if dataclasses.is_dataclass(hints[name]):
                walk(hints[name], prefix + name + ".")
                continue
            default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
            ch = f.metadata.get("choices")
            shown = " | ".join(map(str, ch)) if ch else ("(required)" if default is None and name in
                                                           ("source", "target") else repr(default))
            rows.append((prefix + name, shown, f.metadata["doc"]))

    walk(Recipe, "")
    return rows
