"""What the gateway tells an observer about each generation request (tracing).

The gateway is given an `Observer` at construction (`GatewayConfig.observer`). For
each generation request it asks it once for a `RequestTrace` and calls that at each
step, in order: authentication, admission (with the queue ticket, and the wait in the
queue when there is one), the call to the engine, the end of the request. The trace
sees the steps; it never changes what they decide, except the headers of the engine
call, where it may put its trace context.

`NO_OBSERVER`, the default without tracing, hands out `NO_TRACE`, whose methods do
nothing: a request pays a few empty calls, and nothing per streamed chunk.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from starlette.types import Scope

if TYPE_CHECKING:
    from engine_sidecar.gateway.admission.queue import Ticket
    from engine_sidecar.gateway.errors import ApiError

Headers = list[tuple[bytes, bytes]]


class RequestTrace:
    """One generation request's steps as the gateway runs them; this base class does
    nothing. `ended` is always called, also when a step failed without its end."""

    __slots__ = ()

    def auth_started(self) -> None:
        pass

    def auth_ended(self, tenant_id: str | None, error: ApiError | None) -> None:
        """The tenant, or the refusal."""

    def admission_started(self) -> None:
        pass

    def queued(self, ticket: Ticket) -> None:
        """The request's ticket in its tenant's queue (settled at once, or to wait)."""

    def queue_wait_started(self) -> None:
        pass

    def queue_wait_ended(self, stayed: bool) -> None:
        """The ticket settled (`stayed`), or the client left first."""

    def admission_ended(self, error: ApiError | None, left: bool) -> None:
        """Admitted (the ticket says how), refused (`error`), or the client `left`."""

    def upstream_started(self, method: str, base_url: str, path: str,
                         headers: Headers) -> Headers:
        """The call to the engine is about to be sent with the headers returned."""
        return headers

    def upstream_opened(self) -> None:
        """The engine answered with its status and headers; the body streams next."""

    def upstream_failed(self, error: BaseException) -> None:
        pass

    def ended(self, status: int | None) -> None:
        """The request is over; `status` is what the client got (None: no answer)."""


NO_TRACE = RequestTrace()


class Observer(Protocol):
    def request(self, scope: Scope) -> RequestTrace:
        """The trace of a generation request that just arrived."""
        ...


class NoObserver:
    """No tracing: every request gets `NO_TRACE`."""

    __slots__ = ()

    def request(self, scope: Scope) -> RequestTrace:
        return NO_TRACE


NO_OBSERVER = NoObserver()
