"""GET /v1/models: the engine's model list, for a tenant, with server paths replaced by
the served name (`model_names`)."""

from __future__ import annotations

import json
from typing import Any

from starlette.types import Receive, Scope, Send

from engine_sidecar.gateway import errors
from engine_sidecar.gateway.errors import ApiError
from engine_sidecar.gateway.intake.body import declares_body, unread
from engine_sidecar.gateway.intake.entry import Intake
from engine_sidecar.gateway.intake.model_names import public_cards
from engine_sidecar.gateway.relay.exchange import Upstream, request_headers, send_error

JSON_HEADERS = [(b"content-type", b"application/json")]
MAX_MODEL_LIST_BYTES = 1024 * 1024  # the engine's /v1/models answer, read whole


class ModelsRoute:
    def __init__(self, intake: Intake, upstream: Upstream) -> None:
        self.intake = intake
        self.upstream = upstream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            active = self.intake.active()
            self.intake.authenticate(active, scope["headers"])
            status, payload = await self._engine_models(scope)
        except ApiError as error:
            await send_error(send, unread(scope, error))
            return
        body = json.dumps(public_cards(payload, active.policy.model),
                          separators=(",", ":")).encode()
        headers = [*JSON_HEADERS, (b"content-length", str(len(body)).encode())]
        if declares_body(scope):
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _engine_models(self, scope: Scope) -> tuple[int, Any]:
        forward_headers = request_headers(scope["headers"])
        response = await self.upstream.open("GET", "/v1/models", forward_headers, b"")
        try:
            if response.status_code >= 500:
                raise self.upstream.failure_status(response.status_code)
            chunks: list[bytes] = []
            size = 0
            async for chunk in response.aiter_raw():
                size += len(chunk)
                if size > MAX_MODEL_LIST_BYTES:
                    raise ValueError("model list too large")
                chunks.append(chunk)
            return response.status_code, json.loads(b"".join(chunks))
        except OSError as exc:
            raise self.upstream.failure(exc) from None
        except ValueError:
            raise ApiError(502, errors.UPSTREAM_ERROR,
                           "the inference engine's /v1/models answer is not a JSON model "
                           "list") from None
        finally:
            await response.aclose()
