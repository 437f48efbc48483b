"""The one error type a user sees: a single line naming what is wrong."""


class GkError(Exception):
    """A user-facing failure: bad input, a missing file, an impossible recipe.

    The CLI prints ``str(err)`` on one line and exits non-zero; nothing else is shown.
    """

    def __init__(self, message: str):
        super().__init__(" ".join(message.split()))
