"""Reference logits from transformers' GptOssForCausalLM (Mxfp4Config(dequantize=True), CPU, fp32,
eager attention), teacher-forced over prompt + greedy continuation, saved as safetensors so CI can
verify a build without transformers.

A golden file holds ``token_ids`` [P, T] (prompt then continuation), ``logits`` [P, T, V] (the
logits after each token: position t predicts token t+1), ``hidden`` [P, L, T, H] (the residual
stream after every decoder layer), ``routing`` [P, L, T, k] (the experts the router chose) and, in
its metadata, the prompt length, the checkpoint's content hash and the tool versions.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import GkError

FORMAT = "gkbuild-golden-1"


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
    prompt_len: int
    meta: dict

    def save(self, path: Path) -> None:
        from safetensors.torch import save_file

        from .checkpoint.safetensors_io import fsync_dir

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.partial")
        meta = {"format": FORMAT, "prompt_len": str(self.prompt_len), "meta": json.dumps(self.meta, sort_keys=True)}
        save_file({"token_ids": self.token_ids.contiguous(), "logits": self.logits.contiguous(),
                   "hidden": self.hidden.contiguous(), "routing": self.routing.contiguous()}, str(tmp), metadata=meta)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # safetensors creates it owner-only; a golden is shared like any output
        tmp.replace(path)
        fsync_dir(path.parent)

    @classmethod
    def load(cls, path: Path) -> "Golden":
        from safetensors import safe_open

        from .checkpoint.safetensors_io import read_header

        read_header(Path(path))  # one clear line for a damaged file
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT:
                raise GkError(f"{path}: not a gkbuild golden file (format {meta.get('format')!r})")
            t = {k: f.get_tensor(k) for k in ("token_ids", "logits", "hidden", "routing")}
        return cls(t["token_ids"], t["logits"], t["hidden"], t["routing"], int(meta["prompt_len"]),
                   json.loads(meta["meta"]))


def compute(ckpt_dir: Path, prompts: list[list[int]], steps: int, checkpoint_files: list[dict] | None = None) -> Golden:
    """Run the reference model: greedy continuation of each prompt by ``steps`` tokens, then one
    teacher-forced pass over the whole sequence for logits and per-layer hidden states."""
    try:
        import transformers
        from transformers import GptOssForCausalLM, Mxfp4Config
    except ImportError:
        raise GkError("computing reference logits needs transformers (pip install transformers)") from None
    if len({len(p) for p in prompts}) != 1:
        raise GkError("all prompts must have the same length")
    transformers.utils.logging.set_verbosity_error()  # the CPU dequantize notice is expected here
    transformers.utils.logging.disable_progress_bar()
    model = GptOssForCausalLM.from_pretrained(str(ckpt_dir), quantization_config=Mxfp4Config(dequantize=True),
                                              dtype=torch.float32, attn_implementation="eager").eval()
    ids = torch.tensor(prompts, dtype=torch.int64)
    with torch.no_grad():
        for _ in range(steps):
            nxt = model(ids).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
        captured: list[torch.Tensor] = []
        routes: list[torch.Tensor] = []
        hooks = [layer.register_forward_hook(lambda mod, inp, out: captured.append(
            (out[0] if isinstance(out, tuple) else out).detach().clone())) for layer in model.model.layers]
        hooks += [layer.mlp.router.register_forward_hook(lambda mod, inp, out: routes.append(out[2].detach().clone()))
                  for layer in model.model.layers]  # (logits, scores, indices)
        try:
            logits = model(ids).logits.to(torch.float32)
        finally:
            for h in hooks:
                h.remove()
    hidden = torch.stack(captured, dim=1).to(torch.float32)  # [P, L, T, H]
    P, T = ids.shape
    routing = torch.stack([r.view(P, T, -1) for r in routes], dim=1).to(torch.int64)  # [P, L, T, k]
    meta = {"transformers": transformers.__version__, "torch": torch.__version__, "steps": steps,
            "model": model.config.model_type, "vocab_size": model.config.vocab_size,
            "checkpoint_sha256": checkpoint_hash(checkpoint_files) if checkpoint_files else None}
    return Golden(ids, logits, hidden, routing, len(prompts[0]), meta)


def for_checkpoint(root: Path, prompts, steps: int) -> Golden:
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
    return compute(root, prompts, steps, files)
