"""The output tokens of one relayed response, read as it streams past.

The meter only looks; chunks pass untouched. At the end it takes the count the engine
reports when there is one (`usage` of a non-streamed answer, of a stream with
`include_usage`, or of the Responses API's `response.completed` event); otherwise it
counts token events (one per decode step per choice at vLLM's default stream interval),
which can only run low. The count so far re-estimates the request's remainder while it
streams (`Reservation.progress`), and the final one teaches the tenant's output
estimate. A low count moves what is reserved ahead, never what is accounted as held
(that comes from the plugin's stats). Per chunk: one `count` and a deque append.
"""

from __future__ import annotations

import re
from collections import deque

TAIL_BYTES = 4096  # where a response's final usage sits (its last event or its end)
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_OUTPUT_TOKENS = re.compile(rb'"output_tokens"\s*:\s*(\d+)')
_JSON_EVENT = b"data: {"
_TEXT_DELTA_EVENT = b"event: response.output_text.delta"


class OutputMeter:
    """Counts one response's output tokens; `route` is the request's `Kind` value."""

    __slots__ = ("_marker", "_tail", "_tail_bytes", "events", "route")

    def __init__(self, route: str) -> None:
        self.route = route
        self._marker = _TEXT_DELTA_EVENT if route == "responses" else _JSON_EVENT
        self.events = 0
        # The latest chunks, as many as cover TAIL_BYTES: joined only at the end.
        self._tail: deque[bytes] = deque()
        self._tail_bytes = 0

    @property
    def tail(self) -> bytes:
        """The response's last TAIL_BYTES bytes (all of it, if shorter)."""
        return b"".join(self._tail)[-TAIL_BYTES:]

    def feed(self, chunk: bytes) -> None:
        self.events += chunk.count(self._marker)
        tail = self._tail
        tail.append(chunk)
        size = self._tail_bytes + len(chunk)
        while size - len(tail[0]) >= TAIL_BYTES:
            size -= len(tail.popleft())
        self._tail_bytes = size

    def decoded(self, n: int = 1) -> int:
        """The output tokens streamed so far over all `n` choices, by their token events
        (0 for a response that is not streamed): what admission re-estimates a running
        request's remainder from (`Reservation.progress`)."""
        opening = n if self.route == "chat" else 0
        return max(0, self.events - opening)

    def output_tokens(self, n: int = 1) -> int | None:
        """The response's output tokens over all its `n` choices (None: nothing seen)."""
        pattern = _OUTPUT_TOKENS if self.route == "responses" else _COMPLETION_TOKENS
        found = pattern.findall(self.tail)
        if found:
            return int(found[-1])
        if not self.events:
            return None
        opening = n if self.route == "chat" else 0  # a chat stream's role-only events
        return max(0, self.events - opening)
