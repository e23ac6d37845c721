"""The request path's JSON (`json_codec`): msgspec's speed, the standard library's answers.

Every document gives what `json.loads` gives (so the sidecar accepts, refuses and forwards
exactly what it did with `json` alone), and every encoded body parses back to the value.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_sidecar.gateway import json_codec
from engine_sidecar.gateway.intake.openai_request import Kind, parse, rewrite

SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2**80), 2**80),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20))
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=16)


def _same(a: Any, b: Any) -> bool:
    """Equal, and of the same JSON types all the way down (1 is not 1.0 here)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@settings(max_examples=300, deadline=None)
@given(value=VALUES, ascii_only=st.booleans())
def test_standard_json_parses_as_the_standard_library_does(value: Any, ascii_only: bool
                                                           ) -> None:
    raw = json.dumps(value, ensure_ascii=ascii_only).encode()
    parsed, strict = json_codec.loads_strict(raw)
    assert strict
    assert _same(parsed, json.loads(raw))
    assert _same(json.loads(json_codec.dumps(parsed)), parsed)


@pytest.mark.parametrize("raw", [
    b'{"a": NaN, "b": Infinity}',  # Python's json extensions
    b'{"a": 1e400}',  # past the float range: inf
    b'{"a": "\\ud800 lone"}',  # a lone surrogate
    '{"a": "\u00e9"}'.encode("utf-16"),  # json detects UTF-16
])
def test_what_msgspec_refuses_json_decides_and_encodes(raw: bytes) -> None:
    parsed, strict = json_codec.loads_strict(raw)
    assert not strict
    assert _same(parsed, json.loads(raw))
    assert _same(json.loads(json_codec.dumps(parsed, strict)), parsed)


@pytest.mark.parametrize("raw", [b"{", b"\xff\xfe\x00", b"[" * 100_000 + b"]" * 100_000])
def test_invalid_json_raises_what_json_raises(raw: bytes) -> None:
    with pytest.raises((ValueError, RecursionError)):
        json_codec.loads(raw)


def test_a_forwarded_body_keeps_big_integers_and_nan_as_the_client_sent_them() -> None:
    """A 2**70 inside a tool schema stays an exact integer (orjson would make it a float),
    and a NaN in one is forwarded as NaN, not turned into null."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"maximum": 2**70, "minimum": float("nan")}}}}}]
    raw = json.dumps({"messages": [{"role": "user", "content": "hi"}], "tools": tools}
                     ).encode()
    request = parse(Kind.CHAT, raw)
    forwarded = json.loads(rewrite(request, max_tokens=4, priority=1, tenant_id="acme",
                                   session=None, cache_salt=None))
    bounds = forwarded["tools"][0]["function"]["parameters"]["properties"]["x"]
    assert bounds["maximum"] == 2**70 and isinstance(bounds["maximum"], int)
    assert math.isnan(bounds["minimum"])


def test_big_integers_alone_stay_on_the_fast_path_and_exact() -> None:
    raw = json.dumps({"messages": [{"role": "user", "content": "hi"}], "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"m": 2**70}}}]}).encode()
    request = parse(Kind.CHAT, raw)
    assert request.strict
    body = rewrite(request, max_tokens=4, priority=1, tenant_id="acme", session=None,
                   cache_salt=None)
    assert b'"m":1180591620717411303424' in body
