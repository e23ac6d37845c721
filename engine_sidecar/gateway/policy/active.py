"""The policy the sidecar enforces, bundled with what it needs from the secrets dir.

Building the bundle is all-or-nothing: a policy whose JWT key or cache-salt secret is
missing or unusable is refused as a whole, and the last good bundle stays in force.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from engine_sidecar.contract import errors, files
from engine_sidecar.contract.files import write_atomically
from engine_sidecar.contract.policy import EnginePolicy, Isolation
from engine_sidecar.gateway.auth.callers import Authenticator, KeyFileError
from engine_sidecar.gateway.auth.secret_bytes import secret_bytes

logger = logging.getLogger(__name__)

CACHE_SALT_FILE = "cache-salt"
MIN_SALT_SECRET_BYTES = 16


class PolicyRejected(ValueError):
    """A policy (or its secrets) that cannot be enforced; the message is for the operator."""


@dataclass(frozen=True)
class ActivePolicy:
    policy: EnginePolicy  # as this engine enforces it (`EnginePolicy.for_engine`)
    auth: Authenticator
    cache_salts: dict[str, str]  # tenant id -> salt, only for Tenant isolation

    @property
    def version(self) -> str:
        return self.policy.version or self.policy.content_hash()


def _secret_fingerprint(path: Path) -> files.Signature | None:
    try:
        return files.signature(path)
    except OSError:
        return None


def cache_salt(secret: bytes, tenant_id: str) -> str:
    """HMAC(pool secret, tenant id): stable per tenant, unguessable without the secret.

    URL-safe base64 without padding (43 chars): vLLM refuses '/', '@' and '\\' in salts.
    """
    digest = hmac.new(secret, tenant_id.encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def build(policy: EnginePolicy, secrets_dir: Path | None) -> ActivePolicy:
    try:
        auth = Authenticator.from_policy(policy.auth, secrets_dir, policy.tenants)
    except KeyFileError as exc:
        raise PolicyRejected(str(exc)) from None
    isolated = [t for t in policy.tenants.values()
                if t.prefix_cache_isolation == Isolation.TENANT]
    salts: dict[str, str] = {}
    if isolated:
        secret = _read_salt_secret(secrets_dir)
        salts = {t.tenant_id: cache_salt(secret, t.tenant_id) for t in isolated}
    return ActivePolicy(policy=policy, auth=auth, cache_salts=salts)


def _read_salt_secret(secrets_dir: Path | None) -> bytes:
    hint = (
        f"prefix-cache isolation 'Tenant' needs the pool secret file {CACHE_SALT_FILE!r} "
        f"(at least {MIN_SALT_SECRET_BYTES} random bytes) in --secrets-dir"
    )
    if secrets_dir is None:
        raise PolicyRejected(hint + "; no --secrets-dir was given")
    try:
        secret = secret_bytes((secrets_dir / CACHE_SALT_FILE).read_bytes())
    except OSError:
        raise PolicyRejected(hint + "; the file is missing") from None
    if len(secret) < MIN_SALT_SECRET_BYTES:
        raise PolicyRejected(hint + f"; the file has only {len(secret)} bytes")
    return secret


class PolicyHolder:
    """The last good policy, the latest error, and the copy written for the plugin.

    Every source (file poll, ConfigMap watch) feeds raw documents into `offer()`; the
    holder validates, swaps atomically (one attribute assignment) and notifies. The
    active policy is `engine`'s entry of the per-engine split; the plugin gets the
    policy as offered (it picks the same entry by the same pod name).
    """

    def __init__(
        self,
        secrets_dir: Path | None,
        plugin_policy_path: Path | None,
        on_error: Callable[[str], None] | None = None,
        on_change: Callable[[ActivePolicy], None] | None = None,
        engine: str | None = None,
    ) -> None:
        self.engine = engine
        self.secrets_dir = secrets_dir
        self.plugin_policy_path = plugin_policy_path
        self.active: ActivePolicy | None = None
        self.error: str | None = None
        self._on_error = on_error
        # Called whenever a policy became active (a new version, or rebuilt for secrets).
        self._listeners = [on_change] if on_change is not None else []
        self._last_raw: bytes | None = None
        self._latest: EnginePolicy | None = None  # last well-formed policy offered
        self._offered: EnginePolicy | None = None  # the active one, as offered
        self._secret_prints: dict[Path, files.Signature | None] = {}

    def subscribe(self, listener: Callable[[ActivePolicy], None]) -> None:
        """Call `listener` with each policy once it is active."""
        self._listeners.append(listener)

    def offer(self, raw: str | bytes, origin: str) -> bool:
        """Try a policy document; True if it is now the active one."""
        data = raw.encode() if isinstance(raw, str) else raw
        if data == self._last_raw:
            return self.error is None
        self._last_raw = data
        try:
            policy = EnginePolicy.from_json(data)
        except ValueError as exc:
            return self._reject(f"{origin}: invalid EnginePolicy: {_first_lines(exc)}")
        if not policy.version:
            policy = policy.with_version()
        self._latest = policy
        return self._activate(policy, origin)

    def report(self, message: str) -> None:
        """A source problem (file missing, ConfigMap deleted): keep the last good policy."""
        self._last_raw = None  # the document is processed again when it comes back
        if message != self.error:
            self._reject(message)

    def refresh_secrets(self) -> None:
        """Rebuild when a mounted secret changed (kubelet swaps Secret volumes in place)."""
        if self.active is None and self.error is None:
            return
        prints = self._fingerprints()
        if prints == self._secret_prints:
            return
        self._secret_prints = prints
        if self._latest is not None and (
            self.active is None or self._latest.version != self.active.version
        ):
            self._activate(self._latest, "secrets")  # the refused one may work now
        elif self._offered is not None:
            self._activate(self._offered, "secrets")

    def _fingerprints(self) -> dict[Path, files.Signature | None]:
        if self.secrets_dir is None:
            return {}
        names = {CACHE_SALT_FILE}
        # The active policy's key file, and the latest one's (refused maybe only because
        # its key was not mounted yet: it is retried when the file appears).
        for policy in (self.active.policy if self.active else None, self._latest):
            if policy is not None and policy.auth.jwt:
                names.add(policy.auth.jwt.key_file)
        return {self.secrets_dir / n: _secret_fingerprint(self.secrets_dir / n) for n in names}

    def _activate(self, policy: EnginePolicy, origin: str) -> bool:
        try:
            active = build(policy.for_engine(self.engine), self.secrets_dir)
        except PolicyRejected as exc:
            return self._reject(f"{origin}: {exc}")
        previous = self.active
        self.active, self._offered = active, policy
        self.error = None
        self._secret_prints = self._fingerprints()
        if previous is None or previous.version != active.version:
            logger.info("policy %s active (%d tenants, from %s)",
                        active.version, len(policy.tenants), origin)
        for listener in self._listeners:  # also a rebuild for new secrets: a new object
            listener(active)
        self._write_for_plugin(policy)
        return True

    def _write_for_plugin(self, policy: EnginePolicy) -> None:
        if self.plugin_policy_path is None:
            return
        text = policy.to_json()
        try:
            if self.plugin_policy_path.read_text() == text:
                return
        except OSError:
            pass
        try:
            write_atomically(self.plugin_policy_path, text)
            # Not a secret, and the engine container may run as another user.
            os.chmod(self.plugin_policy_path, 0o644)
        except OSError as exc:
            self._reject(f"cannot write the policy for the scheduler plugin: {exc.strerror}")

    def _reject(self, message: str) -> bool:
        self.error = message
        kept = f"; keeping policy {self.active.version}" if self.active else ""
        logger.error("policy refused: %s%s", message, kept)
        if self._on_error is not None:
            self._on_error(message)
        return False


def _first_lines(exc: Exception, limit: int = 6) -> str:
    """`tenants.acme.maxBlocks: ...` per problem, without pydantic's URLs and inputs."""
    if isinstance(exc, ValidationError):
        text = "; ".join(errors.problems(exc)[:limit])
    else:
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text[:1000]
