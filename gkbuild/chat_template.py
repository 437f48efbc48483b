"""A checkpoint's chat template rendered with bounds: it is code from a file, run by transformers'
sandboxed Jinja (which stops attribute tricks, not loops, recursion or memory).

The render runs in a child process (``python -m gkbuild.chat_template``) under a CPU-time and an
address-space limit, with a wall-clock deadline after which it is killed, and gives back at most
``MAX_RENDERED`` characters a prompt. A template that does not parse, raises, recurses, runs out of
memory or time, or renders too much is one line naming the file. The child renders exactly what
``PreTrainedTokenizerBase.apply_chat_template`` renders: transformers' ``render_jinja_template``
(transformers/utils/chat_template_utils.py) over the tokenizer's special tokens.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys

from . import jsonio
from .errors import GkError

CPU_SECONDS = 3  # a user turn renders in milliseconds
WALL_SECONDS = 120  # start-up (importing transformers) on a loaded host included
MEMORY = 2 << 30  # the child's address space
MAX_RENDERED = 1 << 20  # characters a rendered prompt may have


def render(template: str, texts: list[str], special: dict, where: str) -> list[str]:
    """Each text rendered as one user turn of ``template``, ready for the assistant's reply;
    ``special``: the tokenizer's special tokens map (what the template sees besides the messages)."""
    job = json.dumps({"template": template, "texts": texts, "special": special})
    try:
        p = subprocess.run([sys.executable, "-m", __name__], input=job.encode(), capture_output=True,
                           timeout=WALL_SECONDS)
    except subprocess.TimeoutExpired:
        raise GkError(f"{where}: the chat template did not finish rendering in {WALL_SECONDS} s; refused") from None
    if p.returncode == -signal.SIGXCPU:
        raise GkError(f"{where}: the chat template did not finish rendering in {CPU_SECONDS} s of CPU; refused")
    try:
        out = jsonio.loads(p.stdout, f"{where}: the template renderer's answer", 12 * MAX_RENDERED * len(texts) + 4096)
    except jsonio.BadJson:
        how = f"killed by signal {-p.returncode}" if p.returncode < 0 else f"exit status {p.returncode}"
        last = p.stderr.decode(errors="replace").strip().splitlines()[-1:] or [how]
        raise GkError(f"{where}: the chat template renderer failed ({last[0][:200]})") from None
    if "error" in out:
        raise GkError(f"{where}: the chat template {out['error']}")
    return out["rendered"]


def _limit() -> None:
    import resource

    used = resource.getrusage(resource.RUSAGE_SELF)
    cpu = int(used.ru_utime + used.ru_stime) + 1 + CPU_SECONDS
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 2))  # past it: SIGXCPU, which ends the process
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:200] if text else '(no message)'}"


def main() -> None:
    job = json.loads(sys.stdin.buffer.read())
    from jinja2 import TemplateError
    from transformers.utils.chat_template_utils import render_jinja_template

    _limit()
    try:
        rendered, _ = render_jinja_template(
            conversations=[[{"role": "user", "content": t}] for t in job["texts"]],
            chat_template=job["template"], add_generation_prompt=True, **job["special"])
        too_long = next((len(r) for r in rendered if len(r) > MAX_RENDERED), None)
        out = ({"error": f"renders {too_long} characters for one prompt, over {MAX_RENDERED}; refused"}
               if too_long else {"rendered": rendered})
    except TemplateError as e:
        out = {"error": f"does not render ({_first_line(e)})"}
    except RecursionError:
        out = {"error": "recurses too deeply; refused"}
    except MemoryError:
        out = {"error": f"ran out of memory (over {MEMORY >> 30} GiB) rendering; refused"}
    except Exception as e:  # noqa: BLE001 - a template's filters and globals raise whatever they raise
        out = {"error": f"does not render ({_first_line(e)})"}
    sys.stdout.write(json.dumps(out))


if __name__ == "__main__":
    main()
