"""How fast the engine answers this sidecar's streams: what a request that reports no
progress is expected to take.

A streamed response tells admission how far it has decoded (`Reservation.progress`), so
its end follows from its own rate. A response that is not streamed says nothing until it
ends; when it holds the capacity a refused request needs, Retry-After comes from the
engine's pace on the streams the sidecar relayed: time to the first token plus each
further token of one sequence, moving averages over completed streamed responses.
"""

from __future__ import annotations

WEIGHT = 0.2  # of each new observation in the moving averages


class DecodePace:
    __slots__ = ("first_token", "per_token")

    def __init__(self) -> None:
        self.first_token: float | None = None  # seconds from sending to the first token
        self.per_token: float | None = None  # seconds per further token of one sequence

    def observe(self, first_token: float, duration: float, tokens: float) -> None:
        """A streamed response completed: its first token came after `first_token`
        seconds, its last after `duration`, `tokens` per sequence in all."""
        if first_token < 0 or tokens < 2 or duration <= first_token:
            return
        per_token = (duration - first_token) / (tokens - 1)
        self.first_token = _average(self.first_token, first_token)
        self.per_token = _average(self.per_token, per_token)

    def lasts(self, tokens: int) -> float | None:
        """Seconds a request decoding `tokens` per sequence takes, from sending to its
        last token, at the pace observed (None: no streamed response completed yet)."""
        if self.first_token is None or self.per_token is None:
            return None
        return self.first_token + max(0, tokens - 1) * self.per_token


def _average(mean: float | None, value: float) -> float:
    return value if mean is None else mean + WEIGHT * (value - mean)
