"""Byte sizes ("20Gi", "256MiB", "1.5G"): one grammar for the CRD's pattern and the daemon's flags.

The CRD's spec.engine.kvCacheMemory pattern is SIZE_PATTERN itself and `kvpilot serve --kv-cache-memory`
parses with parse_size, so a size the API server accepts is a size the daemon starts with, and the other
way round (tests/test_sizes.py checks the two languages are the same).

Units are the Kubernetes quantity suffixes that make sense for bytes: decimal k (Kubernetes' spelling),
K, M, G, T, P and binary Ki, Mi, Gi, Ti, Pi, each optionally followed by B ("256MiB", "1GB"), as the
daemon's flags took them before. Not accepted: lowercase m/g/t/p (in Kubernetes "m" is milli, so "512m"
would mean half a byte there and 512 MB here), E/Ei (an exponent in Kubernetes), signs, exponents,
whitespace and "1." / ".5". The pattern is written for both Python's re and RE2 (what the API server
runs): no lookarounds, no \\d (Unicode digits in Python).
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

__all__ = ["SIZE_PATTERN", "UNITS", "is_size", "parse_size"]

# Suffix -> bytes; "" is plain bytes. A trailing "B" is allowed after any of them.
UNITS: dict[str, int] = {
    "": 1,
    "k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50,
}

_NUMBER = r"[0-9]+(?:\.[0-9]+)?"
# A number with a nonzero digit somewhere: zero bytes is no size, and RE2 has no lookahead to say it.
_POSITIVE = r"(?:[0-9]*[1-9][0-9]*(?:\.[0-9]+)?|[0-9]+\.[0-9]*[1-9][0-9]*)"
_SUFFIX = "(?:" + "|".join(sorted((u for u in UNITS if u), key=lambda u: (-len(u), u))) + ")?B?"

# For the CRD (anchored as the API server needs). Go's $ is the end of the text; Python's also matches
# before a final newline, so Python code should use is_size/parse_size, not this pattern with re.search.
SIZE_PATTERN = f"^{_POSITIVE}{_SUFFIX}$"

_SIZE_RE = re.compile(f"({_NUMBER})({_SUFFIX})")


def parse_size(text: str | int) -> int:
    """Bytes from '268435456', '20Gi', '256MiB', '1.5G' or '1k'; fractions of a byte round up, as
    Kubernetes rounds quantities. Raises ValueError for anything else and for sizes that are not > 0."""
    if isinstance(text, bool) or not isinstance(text, int | str):
        raise ValueError(f"not a size: {text!r}")
    if isinstance(text, int):
        value = text
    else:
        m = _SIZE_RE.fullmatch(text)
        if not m:
            units = ", ".join(u for u in UNITS if u)
            raise ValueError(f"not a size: {text!r} (bytes, or a number with one of {units}, optionally "
                             "followed by B: e.g. 20Gi, 256MiB, 1.5G)")
        # Fraction keeps '1.1Ti' exact where a float would round it.
        value = math.ceil(Fraction(m.group(1)) * UNITS[m.group(2).removesuffix("B")])
    if value <= 0:
        raise ValueError(f"size must be > 0, got {text!r}")
    return value


def is_size(text: object) -> bool:
    """Whether parse_size accepts ``text`` (a string; ints are not sizes in a CRD)."""
    if not isinstance(text, str):
        return False
    try:
        parse_size(text)
    except ValueError:
        return False
    return True
