"""Golden files: the streamed reference's logits (``gkbuild.reference``), teacher-forced over
prompt + greedy continuation, saved as safetensors so CI can verify a build without transformers.

A golden file holds ``token_ids`` [P, T] (prompt then continuation), ``logits`` [P, T, V] (the
logits after each token: position t predicts token t+1), ``hidden`` [P, L, T, H] (the residual
stream after every decoder layer), ``routing`` [P, L, T, k] (the experts the router chose),
``router_gap`` [P, L, T] (the reference's margin between its k-th and (k+1)-th router logits: how
near a tie each choice is) and, in its metadata, the prompt length, the KV format the reference
emulated (dtype and dequant scales), the checkpoint's content hash and the tool versions.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from . import jsonio
from .errors import GkError
from .reference import KvFormat

FORMAT = "gkbuild-golden-2"
TENSORS = ("token_ids", "logits", "hidden", "routing", "router_gap")
MAX_GOLDEN = 8 << 30  # 4 prompts x 64 positions of the 120b model are ~0.3 GB


def checkpoint_hash(files: list[dict]) -> str:
    """One hash for a checkpoint: its files' names and sha256s (as the manifest lists them)."""
    items = sorted((f["name"], f["sha256"]) for f in files)
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()


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
    prompt_len: int
    meta: dict

    @property
    def kv(self) -> KvFormat:
        return KvFormat.from_meta(self.meta["kv"])

    def save(self, path: Path) -> None:
        from safetensors.torch import save_file

        from .checkpoint.safetensors_io import fsync_dir

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.partial")
        meta = {"format": FORMAT, "prompt_len": str(self.prompt_len), "meta": json.dumps(self.meta, sort_keys=True)}
        save_file({k: getattr(self, k).contiguous() for k in TENSORS}, str(tmp), metadata=meta)
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
            if meta.get("format") == "gkbuild-golden-1":
                raise GkError(f"{path}: a golden of an older gkbuild (no KV format, no router margins); "
                              f"regenerate it with `gkbuild golden`")
            if meta.get("format") != FORMAT:
                raise GkError(f"{path}: not a gkbuild golden file (format {meta.get('format')!r})")
            missing = [k for k in TENSORS if k not in f.keys()]
            if missing:
                raise GkError(f"{path}: golden file lacks tensor {missing[0]}")
            t = {k: f.get_tensor(k) for k in TENSORS}
        try:
            g = cls(**t, prompt_len=int(meta["prompt_len"]), meta=jsonio.loads(meta["meta"], f"{path}: golden metadata"))
            g.kv  # noqa: B018 - validates the recorded KV format
        except (KeyError, ValueError, TypeError) as e:
            raise GkError(f"{path}: golden metadata is damaged ({e})") from None
        P, T = g.token_ids.shape
        if g.logits.shape[:2] != (P, T) or g.hidden.shape[0] != P or g.hidden.shape[2] != T \
                or g.routing.shape[:3] != g.hidden.shape[:3] or g.router_gap.shape != g.hidden.shape[:3]:
            raise GkError(f"{path}: golden tensors disagree in shape")
        return g


def compute(ckpt_dir: Path, prompts: list[list[int]], steps: int, checkpoint_files: list[dict] | None = None,
            kv: KvFormat = KvFormat("bf16"), device: str = "cpu", quiet: bool = True) -> Golden:
    """Run the streamed reference: greedy continuation of each prompt by ``steps`` tokens, every
    position's logits, per-layer hidden states, experts and router margins, K/V stored as ``kv``."""
    try:
        import transformers
    except ImportError:
        raise GkError("computing reference logits needs transformers (pip install transformers)") from None
    from . import reference

    out = reference.run(ckpt_dir, prompts, steps, kv, device, quiet)
    meta = {"transformers": transformers.__version__, "torch": torch.__version__, "steps": steps,
            "vocab_size": out["logits"].shape[-1], "kv": kv.to_meta(), "device": device,
            "checkpoint_sha256": checkpoint_hash(checkpoint_files) if checkpoint_files else None}
    return Golden(**out, prompt_len=len(prompts[0]), meta=meta)


def for_checkpoint(root: Path, prompts, steps: int, kv: KvFormat = KvFormat("bf16"), device: str = "cpu",
                   quiet: bool = True) -> Golden:
    """Reference logits for a checkpoint folder, recording its content hash."""
    from .pipeline.fingerprint import Fingerprints, sha256_file
    from .checkpoint.reader import INDEX, weight_files
    from .checkpoint.source import cache_root

    fps = Fingerprints(cache_root())
    names = ["config.json"] + ([INDEX] if (root / INDEX).exists() else []) + weight_files(root)
    files = []
    for n in names:
        p = root / n
        digest = fps.lookup(p) or sha256_file(p)
        fps.remember(p, digest)
        files.append({"name": n, "sha256": digest})
    fps.save()
    return compute(root, prompts, steps, files, kv, device, quiet)
