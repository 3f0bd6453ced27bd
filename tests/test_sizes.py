"""kvpilot.sizes: the one size grammar of the CRD's kvCacheMemory pattern and `kvpilot serve --kv-cache-memory`.

The central property: the pattern in the CRD, matched as the API server (Go's RE2) matches it, accepts
exactly the strings parse_size accepts, so no spec the server admits crash-loops the daemon."""

from __future__ import annotations

import argparse
import re

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvpilot import sizes
from kvpilot.daemon import args as daemon_args
from kvpilot.operator import crd


def crd_pattern() -> str:
    engine = crd.spec_schema()["properties"]["engine"]["properties"]
    return engine["kvCacheMemory"]["pattern"]


def server_accepts(text: str) -> bool:
    """The CRD pattern with Go's semantics: RE2's $ is the end of the text; Python's also matches before a
    final newline, so the test anchors with \\Z instead. Everything else in the pattern means the same."""
    pattern = crd_pattern()
    assert pattern.startswith("^") and pattern.endswith("$")
    return re.search(pattern[:-1] + r"\Z", text) is not None


def test_the_crd_pattern_is_the_module_pattern():
    assert crd_pattern() == sizes.SIZE_PATTERN
    assert "(?=" not in sizes.SIZE_PATTERN and "(?!" not in sizes.SIZE_PATTERN  # RE2 has no lookaround
    assert "\\d" not in sizes.SIZE_PATTERN  # Unicode digits in Python, ASCII in RE2


@pytest.mark.parametrize("text, value", [
    ("1024", 1024), ("1", 1), ("1B", 1),
    ("1k", 1000), ("1K", 1000), ("1kB", 1000), ("1KB", 1000),
    ("1M", 10**6), ("1G", 10**9), ("1GB", 10**9), ("2T", 2 * 10**12), ("1P", 10**15),
    ("1Ki", 1024), ("512Mi", 512 << 20), ("256MiB", 256 << 20), ("20Gi", 20 << 30), ("1Ti", 1 << 40),
    ("1TiB", 1 << 40), ("1Pi", 1 << 50),
    ("1.5GiB", 3 << 29), ("1.1Ti", 1209462790554), ("0.5Ki", 512), ("007Mi", 7 << 20),
    ("0.5", 1), ("1.5", 2), ("0.0001k", 1),  # a fraction of a byte rounds up, as Kubernetes rounds
    (4096, 4096),
])
def test_parse_size(text, value):
    assert sizes.parse_size(text) == value
    assert daemon_args.parse_size(text) == value
    if isinstance(text, str):
        assert sizes.is_size(text) and server_accepts(text)


@pytest.mark.parametrize("text", [
    "", "0", "0.0", "00Gi", "0Ti", "-1Gi", "+1Gi", "1e9", "1E", "1Ei", "lots", "Gi", ".5Gi", "1.Gi", "1..5Gi",
    "1 Gi", " 1Gi", "1Gi ", "1Gi\n", "1gi", "1gib", "1mb", "512m", "1ki", "1KiBB", "1iB", "1b", "1GiB ",
    "１Gi", "1٫5Gi", "1,5Gi", "1_000",
])
def test_not_sizes(text):
    with pytest.raises(ValueError):
        sizes.parse_size(text)
    with pytest.raises(argparse.ArgumentTypeError):
        daemon_args.parse_size(text)
    assert not sizes.is_size(text) and not server_accepts(text)


@pytest.mark.parametrize("value", [0, -1, True, 1.5, None])
def test_not_sizes_other_types(value):
    with pytest.raises(ValueError):
        sizes.parse_size(value)


def test_zero_says_so():
    with pytest.raises(ValueError, match="> 0"):
        sizes.parse_size("0Gi")


NUMBERS = st.one_of(
    st.from_regex(r"[0-9]{1,4}(\.[0-9]{1,4})?", fullmatch=True),
    st.sampled_from(["0", "00", "0.0", "0.00", "1", "1.", ".1", "1.0", "01", "10", "0.01"]),
)
SUFFIXES = st.sampled_from(
    [*sizes.UNITS, *(u + "B" for u in sizes.UNITS),  # every accepted suffix
     "b", "m", "g", "t", "p", "E", "Ei", "ki", "mi", "gi", "KiBB", "iB", "kb", "mib", "gib", "e3", "n", "u",
     "BB", " Gi", "Gi ", "Gi\n", "\n"])


@settings(max_examples=1500, deadline=None)
@given(st.one_of(
    st.builds(lambda n, u: n + u, NUMBERS, SUFFIXES),
    st.text(alphabet="0123456789.kKMGTPEimBb+-e \n", max_size=10),
    st.from_regex(sizes.SIZE_PATTERN),
    st.text(max_size=6),
))
@example("1Gi\n")
@example("0.0Gi")
def test_the_crd_pattern_accepts_exactly_what_the_daemon_parses(text):
    assert server_accepts(text) == sizes.is_size(text), text


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 10**6), st.sampled_from(sorted(sizes.UNITS)), st.booleans())
def test_whole_numbers_scale_by_their_unit(n, unit, bytes_suffix):
    assert sizes.parse_size(f"{n}{unit}{'B' if bytes_suffix else ''}") == n * sizes.UNITS[unit]


def test_the_operator_refuses_what_pythons_dollar_lets_through():
    """jsonschema's pattern check is Python's re.search, whose $ passes '20Gi\\n'; the operator asks
    parse_size too, so it reports what the API server and the daemon refuse."""
    for text, ok in [("20Gi", True), ("20Gi\n", False)]:
        spec = crd.default_spec({"model": {"uri": "hf://org/m"}, "engine": {"kvCacheMemory": text}})
        errors = crd.validate("ok", spec)
        assert (errors == []) == ok, errors
