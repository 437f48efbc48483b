"""Real text: a checkpoint's own tokenizer (transformers' ``AutoTokenizer`` on its folder, or on the
tokenizer files of its hub or S3 source), prompts rendered as a user turn of its chat template, and
token ids back to text for people to read.
"""

from __future__ import annotations

from pathlib import Path

from .checkpoint.source import SourceSpec
from .errors import GkError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
NEEDED = "tokenizer.json"


def folder(spec: SourceSpec) -> Path:
    """A local folder with the source's tokenizer files (only those are fetched or made: a synth
    source's tokenizer is written without its weights)."""
    if spec.kind == "dir":
        return Path(spec.path)
    if spec.kind == "hf":
        from .checkpoint.hub import tokenizer_files

        return tokenizer_files(spec.uri, TOKENIZER_FILES)
    if spec.kind == "s3":
        from .checkpoint.s3_source import tokenizer_files as s3_tokenizer_files

        return s3_tokenizer_files(spec.uri, TOKENIZER_FILES)
    from .checkpoint.source import synth_cache_dir, synth_config

    done = synth_cache_dir(spec)
    if (done / NEEDED).is_file():
        return done
    from .checkpoint import synth_tokenizer
    from .checkpoint.source import cache_root
    from .pipeline.state import write_bytes_atomic

    out = cache_root() / "synth-tokenizers" / done.name
    if not (out / NEEDED).is_file():
        text, config = synth_tokenizer.build(synth_config(spec))
        import json

        out.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(out / "tokenizer_config.json", (json.dumps(config, indent=2) + "\n").encode())
        write_bytes_atomic(out / NEEDED, text.encode())
    return out


def tokenizer(spec: SourceSpec):
    """The checkpoint's tokenizer, or one line naming ``--prompt-ids`` when it has none."""
    return _load(folder(spec), spec.uri)


def local_tokenizer(spec: SourceSpec):
    """The checkpoint's tokenizer if this host has it without asking a network (a folder, a synth
    preset, a cached hub snapshot or S3 mirror), else None: for showing text, never required."""
    try:
        if spec.kind == "hf":
            from huggingface_hub import constants

            from .checkpoint.hub import _cached_snapshot, parse

            where = _cached_snapshot(Path(constants.HF_HUB_CACHE), parse(spec.uri), [NEEDED])
        elif spec.kind == "s3":
            from . import s3
            from .checkpoint.s3_source import cache_dir

            where = cache_dir(s3.parse(spec.uri))
        else:
            where = folder(spec)
        return None if where is None or not (where / NEEDED).is_file() else _load(where, spec.uri)
    except (GkError, OSError):
        return None


def _load(where: Path, uri: str):
    if not (where / NEEDED).is_file():
        raise GkError(f"{uri}: the checkpoint has no tokenizer ({NEEDED}); give the prompts as token ids "
                      f"with --prompt-ids instead")
    from transformers import AutoTokenizer
    from transformers.utils import logging

    logging.set_verbosity_error()
    try:
        return AutoTokenizer.from_pretrained(str(where))
    except (OSError, ValueError) as e:
        raise GkError(f"{uri}: its tokenizer does not load ({str(e).splitlines()[0]}); "
                      f"give the prompts as token ids with --prompt-ids instead") from None


def encode(tok, texts: list[str], chat: bool = False) -> list[list[int]]:
    """Each text's token ids: as written, or (``chat``) rendered as one user turn of the
    tokenizer's chat template, ready for the assistant's reply."""
    out = []
    for text in texts:
        if chat:
            if not getattr(tok, "chat_template", None):
                raise GkError("--chat: the checkpoint's tokenizer has no chat template")
            ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                          tokenize=True)
            ids = ids["input_ids"] if not isinstance(ids, list) else ids
        else:
            ids = tok(text, add_special_tokens=False)["input_ids"]
        if not ids:
            raise GkError(f"the prompt {text!r} has no tokens")
        out.append([int(i) for i in ids])
    return out


def decode(tok, ids: list[int]) -> str:
    """Token ids as text; an id the tokenizer has no token for shows as <id>."""
    known = tok.convert_ids_to_tokens(list(ids))
    out, run = [], []
    for i, piece in zip(ids, known):
        if piece is None:
            if run:
                out.append(tok.decode(run))
                run = []
            out.append(f"<{i}>")
        else:
            run.append(i)
    if run:
        out.append(tok.decode(run))
    return "".join(out)
