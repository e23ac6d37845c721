"""The data plane through httpx, for installs without httptools.

Same interface and error types as `lean_http.UpstreamPool`; correct, but several
times the CPU per streamed chunk, so the sidecar logs a warning when it has to use it.
Install `uvicorn[standard]` (or `httptools`) for the fast path.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator

import httpx

from engine_sidecar.gateway.upstream.lean_http import (
    UpstreamConnectError,
    UpstreamProtocolError,
    UpstreamTimeout,
    find_header,
)


def _mapped(exc: httpx.HTTPError) -> OSError:
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
        return UpstreamConnectError(type(exc).__name__)
    if isinstance(exc, httpx.TimeoutException):
        return UpstreamTimeout(type(exc).__name__)
    return UpstreamProtocolError(type(exc).__name__)


class HttpxResponse:
    def __init__(self, response: httpx.Response) -> None:
        self._response = response
        self.status_code = response.status_code
        self.raw_headers = [(k.lower(), v) for k, v in response.headers.raw]
        self._body: AsyncGenerator[bytes, None] | None = None

    def header(self, name: bytes) -> bytes | None:
        return find_header(self.raw_headers, name)

    async def aiter_raw(self) -> AsyncGenerator[bytes, None]:
        try:
            async for chunk in self._response.aiter_raw():
                yield chunk
        except httpx.HTTPError as exc:
            raise _mapped(exc) from None

    async def read(self) -> bytes:
        """The body's next piece; b"" once it is all read."""
        if self._body is None:
            self._body = self.aiter_raw()
        async for chunk in self._body:
            if chunk:
                return chunk
        return b""

    async def aclose(self) -> None:
        if self._body is not None:
            await self._body.aclose()
        await self._response.aclose()


class HttpxPool:
    def __init__(self, client: httpx.AsyncClient) -> None:
        self._client = client

    async def request(
        self, method: str, target: str, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> HttpxResponse:
        request = self._client.build_request(method, target, headers=headers, content=body)
        try:
            return HttpxResponse(await self._client.send(request, stream=True))
        except httpx.HTTPError as exc:
            raise _mapped(exc) from None

    def close(self) -> None:
        """The shared httpx client is closed by its owner."""
