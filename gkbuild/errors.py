"""The one error type a user sees: a single line naming what is wrong."""

import contextlib
import reprlib

_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 60
_SHORT.maxlist = _SHORT.maxdict = _SHORT.maxtuple = 6
_SHORT.maxlevel = 3


# Characters a terminal obeys rather than shows: C0 controls but newline and tab, DEL, C1 controls
# (ESC starts an ANSI sequence; 0x9b is a one-byte CSI), and the Unicode bidi overrides that reorder
# what follows them.
_OBEYED = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F, *range(0x80, 0xA0)) if c not in (0x09, 0x0A)}
_OBEYED.update({c: f"\\u{c:04x}" for c in (0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A))})


def printable(text: str) -> str:
    """``text`` as it may reach a terminal: what a peer, a store or a file supplied (an error
    message, a name) has its control characters shown escaped (``\\x1b``), never obeyed."""
    return text.translate(_OBEYED)


class GkError(Exception):
    """A user-facing failure: bad input, a missing file, an impossible recipe.

    The CLI prints ``str(err)`` on one line and exits non-zero; nothing else is shown.
    """

    def __init__(self, message: str):
        super().__init__(" ".join(message.split()))


def shown(value) -> str:
    """``repr(value)`` cut short: a value from a hostile file never makes an error line huge (or
    costs memory to print)."""
    return _SHORT.repr(value)


def os_error(e: OSError) -> str:
    """An OSError as one line naming the file: ``PATH: No space left on device``."""
    names = [str(n) for n in (e.filename, e.filename2) if n is not None]
    return f"{' -> '.join(names) or 'gkbuild'}: {e.strerror or e}"


@contextlib.contextmanager
def naming(path):
    """An OSError raised inside that names no file (a write's own: a full disk, a quota) raised
    again naming ``path``, so the one line printed says which file could not be written."""
    try:
        yield
    except OSError as e:
        if e.filename is not None:
            raise
        raise OSError(e.errno, e.strerror or str(e), str(path)) from None
