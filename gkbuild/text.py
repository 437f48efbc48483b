"""Real text: a checkpoint's own tokenizer (transformers' ``AutoTokenizer`` on its folder, or on the
tokenizer files of its hub or S3 source), prompts rendered as a user turn of its chat template, and
token ids back to text for people to read.

The tokenizer files are input like any other: each is read once through ``jsonio`` (a regular file,
bounded, strict, shallow JSON), the fields transformers reads are checked for their types, and only
those checked bytes (copied to a private folder) reach ``AutoTokenizer``. The chat template is code:
``chat_template`` renders it with bounds.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from . import jsonio
from .checkpoint.source import SourceSpec
from .errors import GkError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
NEEDED = "tokenizer.json"
TEMPLATE_FILE = "chat_template.jinja"
MAX_FILE = 64 << 20  # gpt-oss's tokenizer.json is 27 MB


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
    if not os.path.lexists(where / NEEDED):
        raise GkError(f"{uri}: the checkpoint has no tokenizer ({NEEDED}); give the prompts as token ids "
                      f"with --prompt-ids instead")
    from transformers import AutoTokenizer
    from transformers.utils import logging

    logging.set_verbosity_error()
    with tempfile.TemporaryDirectory(prefix="gkbuild-tokenizer-") as tmp:
        for name in (*TOKENIZER_FILES, "config.json"):  # config.json: the model type, when no tokenizer_class
            if os.path.lexists(where / name):
                (Path(tmp) / name).write_bytes(_checked(where / name))
        try:
            tok = AutoTokenizer.from_pretrained(tmp)
        except Exception as e:  # noqa: BLE001 - transformers' loaders raise whatever a malformed field causes
            text = str(e).strip()
            raise GkError(f"{uri}: its tokenizer does not load ({type(e).__name__}: "
                          f"{text.splitlines()[0][:200] if text else 'no message'}); "
                          f"give the prompts as token ids with --prompt-ids instead") from None
    tok.name_or_path = str(where)  # where its files are, not the private copy
    return tok


def _token(v) -> bool:
    return v is None or isinstance(v, str) or isinstance(v, dict) and isinstance(v.get("content"), str)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _templates(v) -> bool:
    return isinstance(v, str) or isinstance(v, list) and all(
        isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str) for t in v)


# The fields of each tokenizer file that transformers reads, and what each must be (absent is fine).
_CONFIG = {"tokenizer_class": (lambda v: isinstance(v, str), "a string"),
           "chat_template": (_templates, "a template string or a list of {name, template}"),
           "model_max_length": (_number, "a number"),
           **{k: (_token, "a token (a string or {content: ...})") for k in
              ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")},
           "additional_special_tokens": (lambda v: isinstance(v, list) and all(map(_token, v)), "a list of tokens"),
           "added_tokens_decoder": (lambda v: isinstance(v, dict) and all(
               isinstance(x, dict) and isinstance(x.get("content"), str) for x in v.values()),
               "a map of id -> {content: ...}")}
FIELDS = {"tokenizer_config.json": _CONFIG, "special_tokens_map.json": _CONFIG, "config.json": {},
          "tokenizer.json": {"model": (lambda v: isinstance(v, dict), "an object"),
                             "added_tokens": (lambda v: isinstance(v, list) and all(
                                 isinstance(x, dict) and isinstance(x.get("id"), int) and isinstance(x.get("content"), str)
                                 for x in v), "a list of {id, content}"),
                             **{k: (lambda v: v is None or isinstance(v, dict), "an object or null")
                                for k in ("normalizer", "pre_tokenizer", "post_processor", "decoder")}}}


def _checked(p: Path) -> bytes:
    """A tokenizer file's bytes once read through ``jsonio`` and its fields' types checked."""
    try:
        data = jsonio.read_bounded(p, MAX_FILE)
    except FileNotFoundError:
        raise GkError(f"{p}: missing (a dangling link?)") from None
    except IsADirectoryError:
        raise GkError(f"{p}: is a folder, not a tokenizer file") from None
    if p.name == TEMPLATE_FILE:
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise GkError(f"{p}: not UTF-8 text (byte {e.start}); not a chat template") from None
        return data
    doc = jsonio.loads(data, str(p))
    if not isinstance(doc, dict):
        raise GkError(f"{p}: not a JSON object; not a tokenizer file")
    for k, (ok, what) in FIELDS[p.name].items():
        if k in doc and not ok(doc[k]):
            raise GkError(f"{p}: {k} is not {what}; not a tokenizer file transformers can read")
    return data


def encode(tok, texts: list[str], chat: bool = False) -> list[list[int]]:
    """Each text's token ids: as written, or (``chat``) rendered as one user turn of the
    tokenizer's chat template, ready for the assistant's reply."""
    if chat:
        texts = _rendered(tok, texts)
    out = []
    for text in texts:
        ids = tok(text, add_special_tokens=False)["input_ids"]  # a rendered template carries its own specials
        if not ids:
            raise GkError(f"the prompt {text!r} has no tokens")
        out.append([int(i) for i in ids])
    return out


def _rendered(tok, texts: list[str]) -> list[str]:
    """Each text as one user turn of the tokenizer's chat template (what ``apply_chat_template``
    renders before it tokenizes), rendered with bounds."""
    from . import chat_template

    if not getattr(tok, "chat_template", None):
        raise GkError("--chat: the checkpoint's tokenizer has no chat template")
    where = Path(tok.name_or_path)
    where = where / (TEMPLATE_FILE if (where / TEMPLATE_FILE).exists() else "tokenizer_config.json")
    try:
        template = tok.get_chat_template()
    except ValueError as e:
        raise GkError(f"{where}: {str(e).splitlines()[0][:200]}") from None
    special = {k: [str(x) for x in v] if isinstance(v, (list, tuple)) else str(v)
               for k, v in tok.special_tokens_map.items()}
    return chat_template.render(template, texts, special, str(where))


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
