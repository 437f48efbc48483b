"""Sizes as a user writes them: the one parser of every size option (``--max-shard-size``,
``--scratch-limit``); ``summary.human_bytes`` writes them back."""

from __future__ import annotations

import re

from .errors import GkError, shown

# Binary multiples whatever the spelling (4GB is 4 GiB, as the options have always read it).
UNITS = {"b": 0, "k": 10, "m": 20, "g": 30, "t": 40}
# ASCII digits only (str.isdigit and float() take Arabic-Indic or full-width digits), one optional
# fraction, then a unit: no sign, no exponent, no underscores, nothing around it.
_SIZE = re.compile(r"(\d{1,15})(?:\.(\d{1,9}))? ?([bkmgt])(?:(?<=b)|i?b)?", re.ASCII | re.IGNORECASE)


def parse_size(text: str, option: str) -> int:
    """Bytes of ``text`` such as ``4GB``, ``512MiB``, ``1.5k``: positive, with a unit; else one
    line naming ``option``."""
    m = _SIZE.fullmatch(text) if isinstance(text, str) else None
    if m:
        whole, frac, unit = m.groups()
        shift = UNITS[unit.lower()]
        n = (int(whole) << shift) + (int(frac) << shift) // 10 ** len(frac) if frac else int(whole) << shift
        if n > 0:
            return n
    raise GkError(f"{option}: {shown(text)} is not a size like 4GB, 512MiB or 1.5GiB (ASCII digits, more than "
                  f"0 bytes, with a unit)")
