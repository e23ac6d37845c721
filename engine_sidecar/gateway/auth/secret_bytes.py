"""The key material in a mounted secret file.

A text secret written with `echo` or an editor ends in a newline that is not part of
it; a binary secret (`openssl rand 32`, `head -c 32 /dev/urandom`) may end in a newline
byte that is. Only a text secret loses its one trailing newline.
"""

from __future__ import annotations

_PRINTABLE = frozenset(range(0x20, 0x7F))


def secret_bytes(data: bytes) -> bytes:
    for ending in (b"\r\n", b"\n"):
        if data.endswith(ending):
            text = data[: -len(ending)]
            return text if _PRINTABLE.issuperset(text) else data
    return data
