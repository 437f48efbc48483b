"""The one error type a user sees: a single line naming what is wrong."""

import reprlib

_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 60
_SHORT.maxlist = _SHORT.maxdict = _SHORT.maxtuple = 6
_SHORT.maxlevel = 3


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
