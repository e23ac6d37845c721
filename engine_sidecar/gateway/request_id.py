"""`x-request-id` on every answer of the client port, the sidecar's own refusals included.

OpenAI's SDKs read it into `exc.request_id` and `response._request_id`, so a failed call
can be matched to a log line. The id is the client's when it sent a usable one (visible
ASCII, at most `MAX_CHARS`), a new one otherwise. It replaces whatever the client sent in
the request's headers, so the engine gets it (vLLM names its request after it: vLLM
keeps request ids unique internally whatever clients send), and it is the current
request id of the task serving the request and of every task that task starts
(`current`): `LogFilter` puts it on log records (the sidecar's log format shows it), the
tracing observer on every span (`kvquota.request_id`).
"""

from __future__ import annotations

import logging
import re
import uuid
from contextvars import ContextVar

from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = b"x-request-id"
MAX_CHARS = 128
_USABLE = re.compile(rb"[\x21-\x7e]{1,%d}" % MAX_CHARS)

current: ContextVar[str | None] = ContextVar("kvquota_request_id", default=None)


def chosen(headers: list[tuple[bytes, bytes]]) -> str:
    """The client's id when usable, else a new one."""
    for key, value in headers:
        if key.lower() == HEADER:
            value = value.strip()
            if _USABLE.fullmatch(value):
                return value.decode("ascii")
            break
    return uuid.uuid4().hex


def of(scope: Scope) -> str | None:
    """The id `RequestIds` gave this request (None outside it)."""
    for key, value in scope.get("headers", ()):
        if key == HEADER:
            return str(value.decode("ascii"))
    return None


class RequestIds:
    """ASGI wrapper: one id per HTTP request, in its headers, context and response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = chosen(scope["headers"])
        raw = request_id.encode("ascii")
        scope["headers"] = [*((k, v) for k, v in scope["headers"] if k.lower() != HEADER),
                            (HEADER, raw)]
        token = current.set(request_id)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [
                    *((k, v) for k, v in message.get("headers", ()) if k.lower() != HEADER),
                    (HEADER, raw)]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            current.reset(token)


class LogFilter(logging.Filter):
    """Adds `request_id` to every record (`-` outside a request), for the log format."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = current.get() or "-"
        return True


LOG_FILTER = LogFilter()
ACCESS_FORMAT = ('%(levelprefix)s [%(request_id)s] %(client_addr)s - "%(request_line)s" '
                 '%(status_code)s')


def label_log_lines() -> None:
    """Every handler of the root logger and uvicorn's gets `LogFilter`; uvicorn's access
    lines (`--access-log`) show the id after the level."""
    from uvicorn.logging import AccessFormatter

    for name in ("", "uvicorn", "uvicorn.error", "uvicorn.access"):
        for handler in logging.getLogger(name).handlers:
            handler.addFilter(LOG_FILTER)  # once per handler: filters are compared
            if name == "uvicorn.access":
                handler.setFormatter(AccessFormatter(ACCESS_FORMAT))
