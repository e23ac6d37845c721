"""OpenAI-style error bodies: every refusal a client sees has a specific code.

Clients of an OpenAI-compatible server parse `{"error": {"message", "type", "code",
"param"}}`; the codes below are stable strings clients and dashboards can match on.
Messages say what to do and never carry secrets, internal URLs or stack traces.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

# 400
INVALID_REQUEST = "INVALID_REQUEST"
PROMPT_TOO_LONG = "PROMPT_TOO_LONG"
REQUEST_EXCEEDS_TENANT_QUOTA = "REQUEST_EXCEEDS_TENANT_QUOTA"
REQUEST_EXCEEDS_ENGINE_CAPACITY = "REQUEST_EXCEEDS_ENGINE_CAPACITY"
# 401 / 403
UNAUTHENTICATED = "UNAUTHENTICATED"
UNKNOWN_TENANT = "UNKNOWN_TENANT"
# 404 / 405 / 408 / 413 / 431
NOT_FOUND = "NOT_FOUND"
MODEL_NOT_FOUND = "model_not_found"  # OpenAI's own code (and type invalid_request_error)
METHOD_NOT_ALLOWED = "METHOD_NOT_ALLOWED"
REQUEST_TIMEOUT = "REQUEST_TIMEOUT"
REQUEST_TOO_LARGE = "REQUEST_TOO_LARGE"
REQUEST_HEADERS_TOO_LARGE = "REQUEST_HEADERS_TOO_LARGE"
# 429
TENANT_BLOCK_QUOTA_EXHAUSTED = "TENANT_BLOCK_QUOTA_EXHAUSTED"
TENANT_CONCURRENCY_EXHAUSTED = "TENANT_CONCURRENCY_EXHAUSTED"
# 502 / 503 / 504
KV_CACHE_WATERMARK_EXCEEDED = "KV_CACHE_WATERMARK_EXCEEDED"
POLICY_NOT_LOADED = "POLICY_NOT_LOADED"
SIDECAR_NOT_READY = "SIDECAR_NOT_READY"
TOKENIZER_BUSY = "TOKENIZER_BUSY"
TOO_MANY_CONNECTIONS = "TOO_MANY_CONNECTIONS"  # --max-connections open (503)
ENGINE_UNAVAILABLE = "ENGINE_UNAVAILABLE"
UPSTREAM_ERROR = "UPSTREAM_ERROR"
UPSTREAM_TIMEOUT = "UPSTREAM_TIMEOUT"
INTERNAL_ERROR = "INTERNAL_ERROR"

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    431: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}


@dataclass(eq=False)
class ApiError(Exception):
    """A refusal with its HTTP status; raised anywhere, rendered once by the app."""

    status: int
    code: str
    message: str
    param: str | None = None
    retry_after: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    error_type: str | None = None  # else the status's (`_TYPES`)

    def __str__(self) -> str:
        return f"{self.status} {self.code}: {self.message}"

    def __reduce__(self) -> tuple[type[ApiError], tuple[object, ...]]:
        """Pickled whole (raised in a tokenizer worker process, re-raised in the app)."""
        return (ApiError, (self.status, self.code, self.message, self.param,
                           self.retry_after, self.headers, self.error_type))

    def body(self) -> bytes:
        error = {
            "message": self.message,
            "type": self.error_type or _TYPES.get(self.status, "error"),
            "code": self.code,
            "param": self.param,
        }
        return json.dumps({"error": error}, separators=(",", ":")).encode()

    def raw_headers(self) -> list[tuple[bytes, bytes]]:
        headers = [(b"content-type", b"application/json")]
        if self.retry_after is not None:
            headers.append((b"retry-after", str(self.retry_after).encode()))
        headers.extend((k.lower().encode(), v.encode("latin-1")) for k, v in self.headers.items())
        return headers


def sse_error_event(error: ApiError) -> bytes:
    """An error delivered inside an already started event stream, as vLLM does."""
    return b"data: " + error.body() + b"\n\n"
