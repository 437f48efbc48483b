"""A checkpoint's chat template rendered with bounds: it is code from a file, run by transformers'
sandboxed Jinja (which stops attribute tricks, not loops, recursion or memory).

The render runs in a forked child (no second interpreter start: milliseconds) under a CPU-time and
an address-space limit, with a wall-clock deadline after which it is killed, and gives back at most
``MAX_RENDERED`` characters a prompt. A template that does not parse, raises, recurses, runs out of
memory or time, or renders too much is one line naming the file. The child renders exactly what
``PreTrainedTokenizerBase.apply_chat_template`` renders: transformers' ``render_jinja_template``
(transformers/utils/chat_template_utils.py) over the tokenizer's special tokens.
"""

from __future__ import annotations

import multiprocessing
import signal

from .errors import GkError

CPU_SECONDS = 3  # a user turn renders in milliseconds
WALL_SECONDS = 60  # the CPU limit's backstop on a loaded host
MEMORY = 2 << 30  # the child's address space, on top of what it inherits
MAX_RENDERED = 1 << 20  # characters a rendered prompt may have


def render(template: str, texts: list[str], special: dict, where: str) -> list[str]:
    """Each text rendered as one user turn of ``template``, ready for the assistant's reply;
    ``special``: the tokenizer's special tokens map (what the template sees besides the messages)."""
    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child, args=(send, template, texts, special), daemon=True)
    child.start()
    send.close()
    try:
        out = receive.recv() if receive.poll(WALL_SECONDS) else None
    except EOFError:  # the child died without an answer
        out = None
    finally:
        receive.close()
        if child.is_alive():
            child.kill()
        child.join()
    if out is None:
        if child.exitcode == -signal.SIGXCPU:
            raise GkError(f"{where}: the chat template did not finish rendering in {CPU_SECONDS} s of CPU; refused")
        how = "did not finish in time" if child.exitcode == -signal.SIGKILL else f"exit status {child.exitcode}"
        raise GkError(f"{where}: the chat template did not render ({how}); refused")
    if "error" in out:
        raise GkError(f"{where}: the chat template {out['error']}")
    return out["rendered"]


def _limit() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_CPU, (CPU_SECONDS, CPU_SECONDS + 2))  # SIGXCPU ends the child
    with open("/proc/self/statm") as f:
        have = int(f.read().split()[0]) * resource.getpagesize()  # what the fork inherited
    resource.setrlimit(resource.RLIMIT_AS, (have + MEMORY, have + MEMORY))


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:200] if text else '(no message)'}"


def _child(send, template: str, texts: list[str], special: dict) -> None:
    from jinja2 import TemplateError
    from transformers.utils.chat_template_utils import render_jinja_template

    _limit()
    try:
        rendered, _ = render_jinja_template(conversations=[[{"role": "user", "content": t}] for t in texts],
                                            chat_template=template, add_generation_prompt=True, **special)
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
    send.send(out)
