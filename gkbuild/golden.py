"""Golden files: the streamed reference's logits (``gkbuild.reference``), teacher-forced over
prompt + continuation, saved as safetensors so CI can verify a build without transformers.

Two modes (meta ``mode``): ``greedy`` continues each prompt with the reference's own argmax, one
reference pass a generated position, each pass reading its routed experts again (a 36-layer 120b
at 4 x 32: ~220 GB read for a 61 GB checkpoint); ``forced`` is given the continuation (text, ids,
or a random one) and runs every position in ONE layer-major pass, each weight read once (~1x the
checkpoint). On the same tokens the two agree to float rounding, not bit for bit: this host's
MKL fp32 GEMM takes another kernel for fewer than 16 rows, so a greedy pass's few rows round
differently from the same rows in the one big pass (tests/test_golden_range.py measures it).

A golden file holds ``token_ids`` [P, T] (prompt then continuation), ``logits`` [P, T, V] (the
logits after each token: position t predicts token t+1), ``hidden`` [P, L, T, H] (the residual
stream after every decoder layer), ``routing`` [P, L, T, k] (the experts the router chose),
``router_gap`` [P, L, T] (the reference's margin between its k-th and (k+1)-th router logits: how
near a tie each choice is), ``final_norm`` [P, T, H] (the final RMSNorm's output, the lm_head's
input), ``expert_inputs`` [n, H] and ``expert_outputs`` [L, E, n, H] (every expert of every layer
on fixed probe rows, routed or not) and, in its metadata, each prompt's length (and text, when it
was given as text), the KV format the reference emulated (dtype and dequant scales), the
checkpoint's content hash and the tool versions.

A golden of a dense (bf16/fp32) source is the MXFP4 reference's (its experts quantized by the
build's scale rule, ``quantized.mx_view``), and in addition holds ``original_logits`` [P, T, V]:
the dense original's logits teacher-forced over the same token ids (one layer-major pass), what
``quality`` measures the quantization's own effect against; its meta ``quantize`` names the scale
rule and the source's layout. The tensor is optional: a golden without it (an MXFP4 source's, or an
older one) is read as before.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from . import jsonio
from .errors import GkError
from .pipeline.manifest import checkpoint_hash
from .reference import KvFormat

FORMAT = "gkbuild-golden-3"
TENSORS = ("token_ids", "logits", "hidden", "routing", "router_gap", "final_norm", "expert_inputs", "expert_outputs")
OPTIONAL = ("original_logits",)  # [P, T, V]: a dense source's original, beside its MXFP4 reference
FLOATS = {"fp32", "bf16", "fp16"}  # what a golden's values may be stored as
OLDER = {"gkbuild-golden-1": "no KV format, no router margins",
         "gkbuild-golden-2": "no per-expert probes, no final-norm output"}
# 4 prompts x 64 positions of the 120b model, with every expert's probe outputs, are ~0.6 GB
MAX_GOLDEN = 8 << 30


def forced_sequences(prompts: list[list[int]], continuations: list[list[int]]) -> list[list[int]]:
    """Each prompt followed by its continuation; one line when they do not pair one-to-one or the
    sequences are not of one length (a golden is rectangular, [P, T])."""
    if len(prompts) != len(continuations):
        raise GkError(f"{len(prompts)} prompt(s) and {len(continuations)} continuation(s): give one continuation "
                      f"a prompt, in order")
    seqs = [list(p) + list(c) for p, c in zip(prompts, continuations)]
    lens = [len(x) for x in seqs]
    if len(set(lens)) > 1:
        raise GkError(f"forced sequences (prompt + continuation) have lengths {lens} tokens; a forced golden needs "
                      f"them all of one length")
    return seqs


def default_prompts(vocab: int, count: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (count, length), generator=g).tolist()


@dataclass
class Golden:
    token_ids: torch.Tensor  # [P, T]
    logits: torch.Tensor  # [P, T, V]
    hidden: torch.Tensor  # [P, L, T, H]
    routing: torch.Tensor  # [P, L, T, k]
    router_gap: torch.Tensor  # [P, L, T]
    final_norm: torch.Tensor  # [P, T, H]
    expert_inputs: torch.Tensor  # [n, H]
    expert_outputs: torch.Tensor  # [L, E, n, H]
    prompt_lens: list[int]
    meta: dict
    original_logits: torch.Tensor | None = None  # [P, T, V] the dense original's (a dense source only)

    @property
    def prompts(self) -> list[str] | None:
        """The prompts as text, when they were given as text."""
        return self.meta.get("prompts")

    @property
    def prompt_len(self) -> int:
        """The one prompt length of a golden whose prompts all have it (a DI prefill computes
        every prompt of a set to the same N-1)."""
        if len(set(self.prompt_lens)) != 1:
            raise GkError(f"the golden's prompts have lengths {sorted(set(self.prompt_lens))}; a prefill over NIXL "
                          f"takes prompts of one length")
        return self.prompt_lens[0]

    @property
    def kv(self) -> KvFormat:
        return KvFormat.from_meta(self.meta["kv"])

    def save(self, path: Path) -> None:
        from safetensors.torch import save_file

        from .checkpoint.safetensors_io import fsync_dir

        path = Path(path)
        replaceable(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.partial")
        if os.path.islink(tmp) or (os.path.lexists(tmp) and not tmp.is_file()):
            raise GkError(f"{tmp}: in the way of the golden's temporary (a link or not a file); refused")
        meta = {"format": FORMAT, "prompt_lens": json.dumps(self.prompt_lens),
                "meta": json.dumps(self.meta, sort_keys=True)}
        save_file({k: getattr(self, k).contiguous() for k in TENSORS + OPTIONAL if getattr(self, k) is not None},
                  str(tmp), metadata=meta)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # safetensors creates it owner-only; a golden is shared like any output
        tmp.replace(path)
        fsync_dir(path.parent)

    @classmethod
    def load(cls, path: Path) -> "Golden":
        from safetensors import safe_open

        from .checkpoint.safetensors_io import read_header

        h = read_header(Path(path))  # one clear line for a damaged file
        declared = sum(t.nbytes for t in h.tensors.values())
        if declared > MAX_GOLDEN:  # sized from the header, before a byte is read
            raise GkError(f"{path}: declares {declared} bytes of tensors; a golden is never over {MAX_GOLDEN}")
        ints = [k for k in ("token_ids", "routing") if k in h.tensors and h.tensors[k].dtype.name not in ("i64", "i32")]
        if ints:
            raise GkError(f"{path}: golden tensor {ints[0]} is {h.tensors[ints[0]].dtype.name}, not integer ids")
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") in OLDER:
                raise GkError(f"{path}: a golden of an older gkbuild ({OLDER[meta['format']]}); "
                              f"regenerate it with `gkbuild golden`")
            if meta.get("format") != FORMAT:
                raise GkError(f"{path}: not a gkbuild golden file (format {meta.get('format')!r})")
            missing = [k for k in TENSORS if k not in f.keys()]
            if missing:
                raise GkError(f"{path}: golden file lacks tensor {missing[0]}")
            t = {k: f.get_tensor(k) for k in TENSORS + OPTIONAL if k in f.keys()}
        try:
            g = cls(**t, prompt_lens=jsonio.loads(meta["prompt_lens"], f"{path}: golden prompt lengths"),
                    meta=jsonio.loads(meta["meta"], f"{path}: golden metadata"))
            g.kv  # noqa: B018 - validates the recorded KV format
        except (KeyError, ValueError, TypeError) as e:
            raise GkError(f"{path}: golden metadata is damaged ({e})") from None
        problem = _values_problem(h, t) or g.problem()
        if problem:
            raise GkError(f"{path}: {problem}")
        return g

    def problem(self) -> str | None:
        """What is inconsistent in this golden's shapes and metadata, if anything."""
        if self.token_ids.ndim != 2 or self.hidden.ndim != 4 or self.expert_outputs.ndim != 4:
            return "golden tensors have the wrong number of dimensions"
        if self.original_logits is not None and self.original_logits.shape != self.logits.shape:
            return (f"golden tensor original_logits is {list(self.original_logits.shape)}, not the logits' "
                    f"{list(self.logits.shape)}")
        P, T = self.token_ids.shape
        _, L, _, H = self.hidden.shape
        if self.logits.shape[:2] != (P, T) or self.hidden.shape[0] != P or self.hidden.shape[2] != T \
                or self.routing.shape[:3] != self.hidden.shape[:3] or self.router_gap.shape != self.hidden.shape[:3] \
                or self.final_norm.shape != (P, T, H) or self.expert_inputs.shape[-1:] != (H,) \
                or self.expert_outputs.shape[:1] != (L,) or self.expert_outputs.shape[2:] != self.expert_inputs.shape:
            return "golden tensors disagree in shape"
        lens = self.prompt_lens
        if not isinstance(lens, list) or len(lens) != P \
                or any(isinstance(n, bool) or not isinstance(n, int) or not 0 < n <= T for n in lens):
            return f"golden prompt lengths are not {P} integers in 1..{T}"
        texts = self.prompts
        if texts is not None and (not isinstance(texts, list) or len(texts) != P
                                  or not all(isinstance(x, str) for x in texts)):
            return f"golden prompt texts are not {P} strings"
        return None


def replaceable(path: Path) -> None:
    """``--out`` must be new or a golden gkbuild wrote (of any format): never a link, never
    someone else's file. Checked before the golden is computed, and again as it is saved."""
    from .checkpoint.safetensors_io import read_header

    path = Path(path)
    if not os.path.lexists(path):
        return
    if os.path.islink(path) or not path.is_file():
        raise GkError(f"{path}: exists and is a link or not a file; give a new file or a golden gkbuild wrote")
    try:
        fmt = read_header(path).metadata.get("format", "")
    except GkError:
        fmt = ""
    if fmt != FORMAT and fmt not in OLDER:
        raise GkError(f"{path}: exists and is not a gkbuild golden; refusing to overwrite it")


def _values_problem(h, t: dict) -> str | None:
    """Why a golden's value tensors cannot be a reference (integer, or NaN, or infinite where a
    model's numbers are finite: only a router gap is infinite, when every expert is chosen), or None."""
    for k in TENSORS + tuple(k for k in OPTIONAL if k in t):
        if k in ("token_ids", "routing"):
            continue
        if h.tensors[k].dtype.name not in FLOATS:
            return f"golden tensor {k} is {h.tensors[k].dtype.name}, not floating point: a bad golden"
        bad = torch.isnan if k == "router_gap" else lambda x: ~torch.isfinite(x)
        if any(bool(bad(c).any()) for c in t[k].reshape(-1).split(1 << 24)):  # bounded temporaries
            what = "NaN" if k == "router_gap" else "NaN or infinite values"
            return f"golden tensor {k} holds {what}: a bad golden (regenerate it with `gkbuild golden`)"
    return None


def compute(ckpt_dir: Path, prompts: list[list[int]], steps: int, checkpoint_files: list[dict] | None = None,
            kv: KvFormat = KvFormat("bf16"), device: str = "cpu", quiet: bool = True, text: dict | None = None,
            continuations: list[list[int]] | None = None, rule: str = "round_up") -> Golden:
    """Run the streamed reference: greedy continuation of each prompt to the longest prompt's
    length plus ``steps`` tokens (or, given ``continuations``, each prompt + its continuation in
    one pass, ``steps`` unused), every position's logits, per-layer hidden states, experts and
    router margins, the final norm's output and every expert on the probe rows, K/V stored as
    ``kv``. ``text``: {"prompts": [...], "chat": bool} when the prompts were given as text. A dense
    source's experts are quantized by ``rule`` (the build's scale rule), and its dense original is
    run too, teacher-forced over the same ids: ``original_logits``."""
    try:
        import transformers
    except ImportError:
        raise GkError("computing reference logits needs transformers (pip install transformers)") from None
    from . import reference

    forced = continuations is not None
    seqs = forced_sequences(prompts, continuations) if forced else prompts
    info: dict = {}
    out = reference.run(ckpt_dir, seqs, 0 if forced else steps, kv, device, quiet, rule=rule,
                        info=info)  # equal lengths: one pass
    original, quantize = None, None
    if info["source_layout"] != "mxfp4":  # sequences of one length: one layer-major pass
        original = reference.run(ckpt_dir, out["token_ids"].tolist(), 0, kv, device, quiet, rule=None)["logits"]
        quantize = {"scale_rule": rule, "source_layout": info["source_layout"]}
    meta = {"transformers": transformers.__version__, "torch": torch.__version__,
            "mode": "forced" if forced else "greedy", "steps": None if forced else steps,
            "vocab_size": out["logits"].shape[-1], "kv": kv.to_meta(), "device": device,
            "checkpoint_sha256": checkpoint_hash(checkpoint_files) if checkpoint_files else None, **(text or {}),
            **({"quantize": quantize} if quantize else {})}
    return Golden(**out, prompt_lens=[len(p) for p in prompts], meta=meta, original_logits=original)


def for_checkpoint(root: Path, prompts, steps: int, kv: KvFormat = KvFormat("bf16"), device: str = "cpu",
                   quiet: bool = True, text: dict | None = None, continuations: list[list[int]] | None = None,
                   reads: dict | None = None, rule: str = "round_up") -> Golden:
    """Reference logits for a checkpoint folder (or a ``checkpoint.ranged.Remote``, read by range),
    recording its content hash. ``reads``, if given, is filled with what was read: ``hash_bytes``
    (read to hash files the listing or the fingerprint cache did not vouch for) and, for a remote,
    ``bytes`` (every byte read from it, the hash's included) and ``source_bytes``. ``rule``: a dense
    source's scale rule (``compute``)."""
    from .pipeline.fingerprint import Fingerprints, sha256_file
    from .checkpoint.reader import INDEX, weight_files
    from .checkpoint.source import cache_root

    reads = {} if reads is None else reads
    fps = Fingerprints(cache_root())
    if not isinstance(root, Path):
        files = remote_files(root, fps)
        reads["hash_bytes"] = root.read_bytes
        g = compute(root, prompts, steps, files, kv, device, quiet, text, continuations, rule)
        reads["bytes"] = root.read_bytes
        reads["source_bytes"] = sum(root.file(n).size for n in root.weight_files()[0])
        return g
    weights = weight_files(root)
    names = ["config.json"] + ([INDEX] if (root / INDEX).exists() else []) + weights
    files, hashed = [], 0
    for n in names:
        p = root / n
        digest = fps.lookup(p)
        if digest is None:
            digest, hashed = sha256_file(p), hashed + p.stat().st_size
        fps.remember(p, digest)
        files.append({"name": n, "sha256": digest})
    fps.save()
    reads.update(hash_bytes=hashed, bytes=None, source_bytes=sum((root / n).stat().st_size for n in weights))
    return compute(root, prompts, steps, files, kv, device, quiet, text, continuations, rule)


def remote_files(remote, fps) -> list[dict]:
    """Each file of a remote checkpoint (its config, index and weights) with its sha256: from the
    listing, remembered by the fingerprint cache (keyed as a streamed build keys them), or read."""
    from .checkpoint.reader import INDEX

    weights, _ = remote.weight_files()
    out = []
    for n in ["config.json", *([INDEX] if INDEX in remote.files() else []), *weights]:
        f = remote.file(n)
        ident = f"{remote.uri}/{n}|{f.size}|{f.tag}"
        digest = f.sha256 or fps.lookup_remote(ident) or remote.sha256(n)
        fps.remember_remote(ident, digest)
        out.append({"name": n, "sha256": digest})
    fps.save()
    return out
