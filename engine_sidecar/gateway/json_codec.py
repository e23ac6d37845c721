"""JSON on the request path: msgspec's C codec where it gives the standard library's
answer, the standard library where it does not.

Measured on the 2-core test machine (issue #18), per 2k-token chat request: parsing the
body 9 -> 4 us, the engine's /tokenize answer (2.5k token ids) 170 -> 47 us, encoding a
body 21 -> 3 us. msgspec keeps integers of any size exact (orjson turns those past 64
bits into floats, which would change a tool schema the engine renders).

What msgspec refuses and `json` accepts decides nothing here: such a document is parsed
again by `json`, so the sidecar accepts and forwards exactly what it did before (NaN and
Infinity, numbers past the float range, lone surrogates, UTF-16 bodies). A document
parsed that way is encoded with `json` too (`Parsed.strict` False): msgspec would write
NaN as null and refuses lone surrogates.
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
