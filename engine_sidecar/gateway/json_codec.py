"""JSON on the request path: msgspec's C codec where it gives the standard library's
answer, the standard library where it does not.

msgspec parses and encodes several times faster than `json` and keeps integers of any
size exact (a tool schema the engine renders must not change). What msgspec refuses and
`json` accepts (NaN and Infinity, numbers past the float range, lone surrogates, UTF-16
bodies) is parsed again by `json`, and encoded with `json` too (`Parsed.strict` False),
so the sidecar accepts and forwards exactly what the standard library would.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

_decoder = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()


def loads_strict(raw: bytes) -> tuple[Any, bool]:
    """(`json.loads(raw)`, whether msgspec parsed it: standard JSON, UTF-8, no NaN, no
    lone surrogates). Raises what `json.loads` raises."""
    try:
        return _decoder.decode(raw), True
    except (msgspec.DecodeError, RecursionError):  # non-standard JSON, or deep: json decides
        return json.loads(raw), False


def loads(raw: bytes) -> Any:
    """`json.loads(raw)`, faster."""
    return loads_strict(raw)[0]


def dumps(value: Any, strict: bool = True) -> bytes:
    """Compact JSON of `value`, UTF-8; parsed, it is `value` again. `strict`: `value`
    holds only what standard JSON can say (it came from `loads_strict` with True, plus
    the ints and strings the sidecar adds); else, or if msgspec cannot, the standard
    library writes it, ASCII-escaped as before (NaN, Infinity, lone surrogates as
    `\\ud800`, which only an escape can carry). Raises ValueError or RecursionError
    when neither can."""
    if strict:
        try:
            return _encoder.encode(value)
        except (TypeError, UnicodeEncodeError, RecursionError, OverflowError):
            pass  # e.g. a lone surrogate in a string the sidecar added: json decides
    return json.dumps(value, separators=(",", ":")).encode()
