"""The output tokens of one relayed response, read as it streams past.

The sidecar relays chunks untouched; the meter only looks. At the end it reads the
count the engine itself reports when the response carries one: the `usage` of a
non-streamed answer (always there), of a stream with `stream_options.include_usage`,
or of the Responses API's final `response.completed` event (`completion_tokens`, or
`output_tokens` on /v1/responses; the last one in the response's tail wins). A
stream without usage is counted by its token events: vLLM sends one event per
decode step per choice (its default stream interval), so the JSON events of a
completions stream, less the role event a chat stream opens each choice with, are its
output tokens; on /v1/responses, the `response.output_text.delta` events.

Exact where usage is present; otherwise a floor: a larger `--stream-interval`, or
vLLM's server merging the deltas it has not sent yet into one event when it lags,
makes it count low. It feeds the learned estimate (`output_estimate`) at the end, and
while a response streams, the count so far (`decoded`) re-estimates the request's
remainder (`Reservation.progress`): a count that runs low leaves more of the request
charged as growth still to come, and what it holds is charged from the plugin's stats
whatever the count, so a miscount moves what is reserved ahead, never what is
accounted as held. Per chunk it costs one `count` and a bounded copy of the tail.
"""

from __future__ import annotations

import re

TAIL_BYTES = 4096  # where a response's final usage sits (its last event or its end)
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_OUTPUT_TOKENS = re.compile(rb'"output_tokens"\s*:\s*(\d+)')
_JSON_EVENT = b"data: {"
_TEXT_DELTA_EVENT = b"event: response.output_text.delta"


class OutputMeter:
    """Counts one response's output tokens; `route` is the request's `Kind` value."""

    __slots__ = ("events", "route", "tail")

    def __init__(self, route: str) -> None:
        self.route = route
        self.events = 0
        self.tail = b""

    def feed(self, chunk: bytes) -> None:
        marker = _TEXT_DELTA_EVENT if self.route == "responses" else _JSON_EVENT
        self.events += chunk.count(marker)
        if len(chunk) >= TAIL_BYTES:
            self.tail = chunk[-TAIL_BYTES:]
        else:
            self.tail = self.tail[len(self.tail) + len(chunk) - TAIL_BYTES:] + chunk \
                if len(self.tail) + len(chunk) > TAIL_BYTES else self.tail + chunk

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
