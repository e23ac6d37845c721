"""vLLM's own API key (`--api-key`, `VLLM_API_KEY`) on every call the sidecar makes to it.

Clients send their tenant's token to the sidecar; vLLM started with an API key wants
its key instead. The client's Authorization header is never forwarded
(`relay.exchange.REQUEST_DROP`); `Authorization: Bearer <key>` goes on every upstream
call, data plane and control client alike. An engine that answers 401 refused the
sidecar, not the tenant: the client gets a 502 naming the setting to check. The key
appears in no error, log line or repr. It comes from `--engine-api-key-file`
($KVQUOTA_ENGINE_API_KEY_FILE), else $VLLM_API_KEY, which injection copies from the
vLLM container.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from engine_sidecar.contract.names import ENGINE_KEY_ENV, ENGINE_KEY_FILE_ENV
from engine_sidecar.gateway import errors
from engine_sidecar.gateway.auth.secret_bytes import secret_bytes
from engine_sidecar.gateway.errors import ApiError

if TYPE_CHECKING:
    from engine_sidecar.gateway.relay.exchange import DataPlane, UpstreamResponse

AUTHORIZATION = b"authorization"


class EngineKey:
    """vLLM's API key, as the header value the sidecar sends (hidden from reprs)."""

    __slots__ = ("header",)

    def __init__(self, key: str) -> None:
        if not key or not key.isprintable() or key != key.strip():
            raise ValueError("vLLM's API key must be a non-empty line of printable text "
                             "without surrounding spaces")
        self.header = b"Bearer " + key.encode("latin-1")

    def __repr__(self) -> str:
        return "EngineKey(<hidden>)"


def load_engine_key(key_file: Path | None, environ: dict[str, str] | None = None
                    ) -> EngineKey | None:
    """The key from `key_file`, else $KVQUOTA_ENGINE_API_KEY_FILE, else $VLLM_API_KEY;
    None when none is set. Raises SystemExit naming the setting (never the key)."""
    env = os.environ if environ is None else environ
    path = key_file or (Path(env[ENGINE_KEY_FILE_ENV]) if env.get(ENGINE_KEY_FILE_ENV) else None)
    if path is not None:
        try:
            text = secret_bytes(path.read_bytes()).decode("latin-1")
        except OSError as exc:
            raise SystemExit(f"--engine-api-key-file {path}: cannot be read "
                             f"({exc.strerror})") from None
        where = f"--engine-api-key-file {path}"
    elif env.get(ENGINE_KEY_ENV):
        text, where = env[ENGINE_KEY_ENV], f"${ENGINE_KEY_ENV}"
    else:
        return None
    try:
        return EngineKey(text)
    except ValueError as exc:
        raise SystemExit(f"{where}: {exc}") from None


class KeyedPlane:
    """A data plane that replaces the Authorization header with vLLM's key (none when
    `key` is None) and turns the engine's 401 into `refused`."""

    def __init__(self, inner: DataPlane, key: EngineKey | None) -> None:
        self._inner = inner
        self._key = key

    async def request(self, method: str, target: str, headers: list[tuple[bytes, bytes]],
                      body: bytes) -> UpstreamResponse:
        headers = [(k, v) for k, v in headers if k.lower() != AUTHORIZATION]
        if self._key is not None:
            headers.append((AUTHORIZATION, self._key.header))
        response = await self._inner.request(method, target, headers, body)
        if response.status_code == 401:
            await response.aclose()
            raise refused(self._key is not None)
        return response

    def close(self) -> None:
        self._inner.close()


def refused(configured: bool) -> ApiError:
    if configured:
        message = ("the inference engine refused the sidecar's API key (HTTP 401): the key "
                   "given by --engine-api-key-file or $VLLM_API_KEY is not one vLLM was "
                   "started with")
    else:
        message = ("the inference engine requires an API key (HTTP 401): give the sidecar "
                   "vLLM's key with --engine-api-key-file or $VLLM_API_KEY")
    return ApiError(502, errors.UPSTREAM_ERROR, message)
