"""Builders shared by the sidecar tests: policies, JWT keys and tokens, servers."""

from __future__ import annotations

import json
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import jwt
import uvicorn
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from starlette.types import ASGIApp

from engine_sidecar.contract.files import write_atomically
from engine_sidecar.contract.policy import EnginePolicy, TenantPolicy
from engine_sidecar.gateway.server import ConnectionLimits, server_config

ISSUER = "https://idp.example.test"
AUDIENCE = "kvquota-test"
HS_KEY_FILE = "jwt-hs"
RSA_KEY_FILE = "jwt-rsa.pem"
EC_KEY_FILE = "jwt-ec.pem"
JWKS_FILE = "jwks.json"


def tenant(tenant_id: str, **overrides: Any) -> TenantPolicy:
    max_blocks = max(10_000, overrides.get("guaranteed_blocks", 0))
    fields: dict[str, Any] = {
        "tenant_id": tenant_id, "tier": "standard", "priority": 1,
        "guaranteed_blocks": 0, "max_blocks_per_engine": max_blocks, "max_tokens": 64,
        "default_max_tokens": min(8, overrides.get("max_tokens", 64)), **overrides,
    }
    return TenantPolicy.model_validate(fields)


def hs_auth(**overrides: Any) -> dict[str, Any]:
    jwt_policy = {"key_file": HS_KEY_FILE, "algorithms": ["HS256"], "issuer": ISSUER,
                  "audience": AUDIENCE, "leeway_seconds": 5, **overrides}
    return {"jwt": jwt_policy}


def rs_auth(**overrides: Any) -> dict[str, Any]:
    return hs_auth(key_file=RSA_KEY_FILE, algorithms=["RS256"], **overrides)


# Every tier reserves prompt + max_tokens (today's no-eviction promise): for tests of
# quotas and the watermark whose arithmetic is in max_tokens, and of the token count.
FULL_RESERVATION = {"premium": "Full", "standard": "Full", "free": "Full"}


def make_policy(*tenants: TenantPolicy, auth: dict[str, Any] | None = None,
                **pool: Any) -> EnginePolicy:
    fields: dict[str, Any] = {
        "pool": "default/test", "model": "tiny", "block_size": 32, "watermark": 0.1,
        "auth": auth if auth is not None else hs_auth(),
        "tenants": {t.tenant_id: t for t in tenants}, **pool,
    }
    return EnginePolicy.model_validate(fields).with_version()


@dataclass
class Keys:
    """Test-only key material, generated per session and written into a secrets dir."""

    dir: Path
    hs_secret: bytes = field(default_factory=lambda: secrets.token_bytes(32))
    rsa: rsa.RSAPrivateKey = field(
        default_factory=lambda: rsa.generate_private_key(public_exponent=65537, key_size=2048))
    ec: ec.EllipticCurvePrivateKey = field(
        default_factory=lambda: ec.generate_private_key(ec.SECP256R1()))

    def rsa_public_pem(self) -> bytes:
        return self.rsa.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)

    def write(self) -> Keys:
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / HS_KEY_FILE).write_bytes(self.hs_secret)
        (self.dir / RSA_KEY_FILE).write_bytes(self.rsa_public_pem())
        (self.dir / EC_KEY_FILE).write_bytes(self.ec.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
        jwks = {"keys": [
            {**json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(self.rsa.public_key())),
             "kid": "rsa-1", "use": "sig"},
            {**json.loads(jwt.algorithms.ECAlgorithm.to_jwk(self.ec.public_key())),
             "kid": "ec-1", "use": "sig"},
        ]}
        (self.dir / JWKS_FILE).write_text(json.dumps(jwks))
        (self.dir / "cache-salt").write_bytes(secrets.token_bytes(32))
        return self

    def claims(self, tenant_id: str | None = "acme", **overrides: Any) -> dict[str, Any]:
        now = int(time.time())
        claims: dict[str, Any] = {"iss": ISSUER, "aud": AUDIENCE, "iat": now,
                                  "exp": now + 300, "sub": "user-1"}
        if tenant_id is not None:
            claims["tenant_id"] = tenant_id
        claims.update(overrides)
        return {k: v for k, v in claims.items() if v is not None}

    def hs(self, tenant_id: str | None = "acme", **claims: Any) -> str:
        return jwt.encode(self.claims(tenant_id, **claims), self.hs_secret, algorithm="HS256")

    def rs(self, tenant_id: str | None = "acme", kid: str | None = None, **claims: Any) -> str:
        headers = {"kid": kid} if kid else None
        return jwt.encode(self.claims(tenant_id, **claims), self.rsa, algorithm="RS256",
                          headers=headers)

    def es(self, tenant_id: str | None = "acme", kid: str | None = None, **claims: Any) -> str:
        headers = {"kid": kid} if kid else None
        return jwt.encode(self.claims(tenant_id, **claims), self.ec, algorithm="ES256",
                          headers=headers)


def unsigned_token(claims: dict[str, Any]) -> str:
    """alg=none, as an attacker would send it."""
    return jwt.encode(claims, None, algorithm="none")


def hs_forged_with(secret: bytes, claims: dict[str, Any]) -> str:
    """An HS256 token signed with arbitrary bytes (e.g. the RSA public key PEM), built by
    hand because PyJWT refuses PEM-looking HMAC keys."""
    import base64
    import hashlib
    import hmac

    def b64(data: bytes) -> bytes:
        return base64.urlsafe_b64encode(data).rstrip(b"=")

    signing_input = (b64(json.dumps({"alg": "HS256", "typ": "JWT"}).encode()) + b"."
                     + b64(json.dumps(claims).encode()))
    signature = hmac.new(secret, signing_input, hashlib.sha256).digest()
    return (signing_input + b"." + b64(signature)).decode()


# The bound of every wait in these tests, for a reply or for something that must
# happen; a wait ends as soon as it is met. What these tests assert is never how fast:
# CI machines have been seen stalling the test process for over 4 s (the demo's load
# generator once woke 4.1 s late), which httpx's default 5 s timeout turned into a
# failure. What never happens still fails, after a minute.
WAIT = 60.0


def http_get(url: str, **kwargs: Any) -> httpx.Response:
    return httpx.get(url, **{"timeout": WAIT, **kwargs})


def http_post(url: str, **kwargs: Any) -> httpx.Response:
    return httpx.post(url, **{"timeout": WAIT, **kwargs})


class ServerThread:
    """Serve an ASGI app with uvicorn on a free port in a background thread.

    `send_buffer` fixes SO_SNDBUF on the listening socket (accepted sockets inherit it
    and lose autotuning), so a client that stops reading blocks the server's send
    after a bounded number of bytes instead of megabytes: held streams stay held.
    With `limits`, the server runs as `kvquota sidecar` runs its ports (the guarded
    protocol, connection limits); without, as plain uvicorn (the stub engine).
    """

    def __init__(self, app: ASGIApp, send_buffer: int | None = None,
                 limits: ConnectionLimits | None = None, lifespan: str = "on") -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if send_buffer:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
        self.sock.bind(("127.0.0.1", 0))
        self.port = int(self.sock.getsockname()[1])
        if limits is None:
            config = uvicorn.Config(app, log_level="warning", access_log=False,
                                    lifespan=lifespan, timeout_graceful_shutdown=2)
        else:
            config = server_config(app, limits, lifespan=lifespan, log_level="warning",
                                   timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True, name=f"uvicorn-{self.port}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> ServerThread:
        self.thread.start()
        wait_for(lambda: self.server.started, timeout, f"server on {self.port} did not start")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()

    @contextmanager
    def running(self) -> Iterator[ServerThread]:
        self.start()
        try:
            yield self
        finally:
            self.stop()


def wait_for(predicate: Callable[[], Any], timeout: float, message: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"{message} (after {timeout:.0f}s)")


def write_policy(path: Path, policy: EnginePolicy) -> None:
    write_atomically(path, policy.to_json())
