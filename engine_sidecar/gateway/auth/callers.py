"""Who is calling: a verified JWT, the anonymous tenant, or a trusted header.

Algorithm confusion is impossible by construction: the pinned algorithms choose the
key type before any token is seen. HMAC algorithms get the raw secret and nothing
else; public-key algorithms get parsed key objects (a PEM or JWKS file) and never a
string that could double as an HMAC secret. A token's `alg` must be one of the pinned
algorithms, so `none` and HS/RS confusion fail before any signature check.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jwt
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from engine_sidecar.contract.policy import AuthPolicy, JwtPolicy
from engine_sidecar.gateway.auth.secret_bytes import secret_bytes
from engine_sidecar.gateway.errors import (
    INVALID_REQUEST,
    UNAUTHENTICATED,
    UNKNOWN_TENANT,
    ApiError,
)

logger = logging.getLogger(__name__)

MAX_TOKEN_BYTES = 16 * 1024
VERIFIED_CACHE_SIZE = 10_000
# A verified token is checked again after this long, however far off its `exp` is.
VERIFIED_CACHE_SECONDS = 300.0
# NumericDate claims past 9999-12-31T23:59:59Z are no date (and 10**400 is no float).
MAX_NUMERIC_DATE = 253_402_300_799
TIME_CLAIMS = ("exp", "nbf", "iat")
MIN_HMAC_KEY_BYTES = 32
_EC_CURVES = {"ES256": "secp256r1", "ES384": "secp384r1", "ES512": "secp521r1"}


class KeyFileError(ValueError):
    """The mounted key does not fit the pinned algorithms; the message says how to fix it."""


@dataclass(frozen=True)
class _PublicKey:
    kid: str | None
    key: Any  # a cryptography public key object
    algorithms: frozenset[str]


def _algorithms_for(key: Any, pinned: Sequence[str]) -> frozenset[str]:
    if isinstance(key, rsa.RSAPublicKey):
        return frozenset(a for a in pinned if a[:2] in ("RS", "PS"))
    if isinstance(key, ec.EllipticCurvePublicKey):
        return frozenset(a for a in pinned if _EC_CURVES.get(a) == key.curve.name)
    return frozenset()


def _load_pem(data: bytes, where: str) -> Any:
    try:
        if b"CERTIFICATE-----" in data:
            return x509.load_pem_x509_certificate(data).public_key()
        if b"PRIVATE KEY-----" in data:
            private = serialization.load_pem_private_key(data, password=None)
            logger.warning(
                "%s holds a private key; only its public half is used. Mount the public "
                "key instead: a verifier never needs the private key.", where
            )
            return private.public_key()
        return serialization.load_pem_public_key(data)
    except (ValueError, TypeError) as exc:
        raise KeyFileError(f"{where}: not a readable PEM public key or certificate") from exc


def _load_jwks(data: bytes, where: str) -> list[tuple[str | None, Any]]:
    try:
        document = json.loads(data)
    except ValueError as exc:
        raise KeyFileError(f"{where}: not valid JSON (expected a JWKS)") from exc
    entries = document.get("keys") if isinstance(document, dict) else None
    if not isinstance(entries, list):
        raise KeyFileError(f"{where}: a JWKS needs a 'keys' list")
    keys: list[tuple[str | None, Any]] = []
    for entry in entries:
        if not isinstance(entry, dict) or entry.get("use", "sig") != "sig":
            continue
        if entry.get("kty") not in ("RSA", "EC"):
            continue  # symmetric ("oct") keys never verify public-key algorithms
        try:
            key = jwt.PyJWK(entry).key
        except jwt.PyJWTError as exc:
            raise KeyFileError(f"{where}: key {entry.get('kid')!r} is not usable: {exc}") from exc
        keys.append((entry.get("kid"), key))
    return keys


@dataclass(frozen=True)
class VerificationKeys:
    """Keys for exactly one algorithm family, as the policy pins."""

    hmac_secret: bytes | None
    public_keys: tuple[_PublicKey, ...]

    @classmethod
    def load(cls, policy: JwtPolicy, secrets_dir: Path | None) -> VerificationKeys:
        if secrets_dir is None:
            raise KeyFileError("auth.jwt is configured but the sidecar has no --secrets-dir")
        name = policy.key_file
        if "/" in name or name.startswith("."):
            raise KeyFileError(f"auth.jwt.keyFile {name!r} must be a plain file name")
        path = secrets_dir / name
        where = f"JWT key file {name!r}"
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise KeyFileError(f"{where} not found in the secrets directory") from exc
        if policy.algorithms[0].startswith("HS"):
            return cls(hmac_secret=_hmac_secret(data, where), public_keys=())
        stripped = data.strip()
        if stripped.startswith(b"{"):
            raw_keys = _load_jwks(stripped, where)
        else:
            raw_keys = [(None, _load_pem(stripped, where))]
        keys = tuple(
            _PublicKey(kid, key, algs)
            for kid, key in raw_keys
            if (algs := _algorithms_for(key, policy.algorithms))
        )
        if not keys:
            raise KeyFileError(
                f"{where} has no key usable with the pinned algorithms "
                f"{', '.join(policy.algorithms)} (RS*/PS* need an RSA key, ES* an EC key "
                "on the matching curve)"
            )
        return cls(hmac_secret=None, public_keys=keys)


def _hmac_secret(data: bytes, where: str) -> bytes:
    secret = secret_bytes(data)
    if b"-----BEGIN" in secret:
        raise KeyFileError(
            f"{where} holds a PEM key but the pinned algorithms are HMAC (HS*); pin the "
            "matching public-key algorithm instead"
        )
    if len(secret) < MIN_HMAC_KEY_BYTES:
        raise KeyFileError(
            f"{where} is {len(secret)} bytes; an HMAC secret needs at least "
            f"{MIN_HMAC_KEY_BYTES} random bytes"
        )
    return secret


def _unauthenticated(message: str, error: str = "invalid_token") -> ApiError:
    challenge = f'Bearer error="{error}"' if error else "Bearer"
    return ApiError(401, UNAUTHENTICATED, message, headers={"www-authenticate": challenge})


def _claim(claims: Mapping[str, Any], path: str) -> Any:
    """`tenant_id`, or a dotted path such as `org.tenant` for nested claims."""
    if path in claims:
        return claims[path]
    value: Any = claims
    for part in path.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return None
        value = value[part]
    return value


class JwtVerifier:
    def __init__(
        self, policy: JwtPolicy, keys: VerificationKeys, clock: Callable[[], float] = time.time
    ) -> None:
        self._policy = policy
        self._keys = keys
        self._clock = clock
        self._pinned = frozenset(policy.algorithms)
        # Verified tokens -> (tenant, until): clients resend the same token on every
        # request, and a signature check costs far more than the rest of admission.
        # Keys or policy changing builds a new verifier, so the cache never outlives them;
        # an entry lasts until the token's expiry, at most VERIFIED_CACHE_SECONDS.
        self._verified: dict[str, tuple[str, float]] = {}
        self._require = ["exp"]
        if policy.issuer:
            self._require.append("iss")
        if policy.audience:
            self._require.append("aud")

    def tenant_of(self, token: str) -> str:
        now = self._clock()
        cached = self._verified.get(token)
        if cached is not None:
            tenant, until = cached
            if now <= until:
                return tenant
            del self._verified[token]
        tenant, expires = self._verify(token, now)
        if len(self._verified) >= VERIFIED_CACHE_SIZE:
            self._verified.pop(next(iter(self._verified)))  # oldest first
        self._verified[token] = (tenant, min(expires, now + VERIFIED_CACHE_SECONDS))
        return tenant

    def _verify(self, token: str, now: float) -> tuple[str, float]:
        if len(token) > MAX_TOKEN_BYTES:
            raise _unauthenticated("bearer token is too large")
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError:
            raise _unauthenticated("bearer token is not a well-formed JWT") from None
        alg = header.get("alg")
        if not isinstance(alg, str) or alg not in self._pinned:
            raise _unauthenticated(
                f"token algorithm {str(alg)[:16]!r} is not accepted; this pool accepts "
                f"{', '.join(sorted(self._pinned))}"
            )
        claims = self._decode(token, alg, header.get("kid"))
        expires = self._check_times(claims, now)
        tenant = _claim(claims, self._policy.tenant_claim)
        if not isinstance(tenant, str) or not tenant:
            raise ApiError(
                403, UNKNOWN_TENANT,
                f"token has no string claim {self._policy.tenant_claim!r} naming the tenant",
            )
        return tenant, expires

    def _check_times(self, claims: Mapping[str, Any], now: float) -> float:
        """Check exp/nbf/iat of a token whose signature verified; its expiry with leeway.

        PyJWT's own time checks are off: they take `int(claim)`, which accepts strings
        and booleans, and let an `exp` of 10**400 through to overflow later."""
        times: dict[str, float] = {}
        for name in TIME_CLAIMS:
            if name not in claims:
                continue
            value = claims[name]
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise _unauthenticated(
                    f"token claim {name!r} must be a JSON number of seconds since the "
                    f"epoch, not {_json_type(value)}"
                )
            finite = isinstance(value, int) or math.isfinite(value)
            if not finite or not 0 <= value <= MAX_NUMERIC_DATE:
                raise _unauthenticated(
                    f"token claim {name!r} is out of range: it must be a time between "
                    "1970 and 9999 in seconds since the epoch"
                )
            times[name] = float(value)
        leeway = self._policy.leeway_seconds
        exp = times["exp"]  # required: decoding refused tokens without it
        if exp <= now - leeway:
            raise _unauthenticated("token has expired; get a new one")
        for name in ("nbf", "iat"):
            if name in times and times[name] > now + leeway:
                raise _unauthenticated(f"token is not valid yet ({name} is in the future)")
        limit = self._policy.max_token_lifetime_seconds
        if limit is not None:
            if exp - now > limit + leeway:
                raise _unauthenticated(
                    f"token expires {exp - now:.0f} s from now; this pool accepts tokens "
                    f"that live at most {limit} s (maxTokenLifetimeSeconds): get a "
                    "shorter-lived one"
                )
            if "iat" in times and exp - times["iat"] > limit:
                raise _unauthenticated(
                    f"token lifetime (exp - iat) is {exp - times['iat']:.0f} s; this pool "
                    f"accepts tokens that live at most {limit} s (maxTokenLifetimeSeconds)"
                )
        return exp + leeway

    def _candidates(self, alg: str, kid: Any) -> list[Any]:
        if self._keys.hmac_secret is not None:
            return [self._keys.hmac_secret]
        usable = [k for k in self._keys.public_keys if alg in k.algorithms]
        if isinstance(kid, str) and any(k.kid for k in usable):
            usable = [k for k in usable if k.kid == kid]
        return [k.key for k in usable]

    def _decode(self, token: str, alg: str, kid: Any) -> dict[str, Any]:
        candidates = self._candidates(alg, kid)
        if not candidates:
            raise _unauthenticated("no configured key matches the token's algorithm and kid")
        options: jwt.types.Options = {
            "require": self._require, "verify_exp": False, "verify_nbf": False,
            "verify_iat": False,  # checked with the claims' types in _check_times
        }
        if not self._policy.audience:
            options["verify_aud"] = False
        last: jwt.PyJWTError | None = None
        for key in candidates:
            try:
                return jwt.decode(
                    token, key, algorithms=[alg], audience=self._policy.audience,
                    issuer=self._policy.issuer, leeway=self._policy.leeway_seconds,
                    options=options,
                )
            except jwt.InvalidSignatureError as exc:
                last = exc  # try the next key (rotation: old and new keys mounted)
            except jwt.PyJWTError as exc:
                raise _token_error(exc) from None
        raise _token_error(last or jwt.InvalidSignatureError()) from None


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, str):
        return "a string"
    if value is None:
        return "null"
    return "an array" if isinstance(value, list) else "an object"


def _token_error(exc: jwt.PyJWTError) -> ApiError:
    if isinstance(exc, jwt.InvalidAudienceError):
        return _unauthenticated("token audience does not match this pool")
    if isinstance(exc, jwt.InvalidIssuerError):
        return _unauthenticated("token issuer does not match this pool")
    if isinstance(exc, jwt.MissingRequiredClaimError):
        return _unauthenticated(f"token lacks the required claim {exc.claim!r}")
    if isinstance(exc, jwt.InvalidSignatureError):
        return _unauthenticated("token signature does not verify with the pool's key")
    if isinstance(exc, jwt.DecodeError):
        return _unauthenticated("bearer token is not a well-formed JWT")
    return _unauthenticated("token is not valid")


class Authenticator:
    """Maps a request's headers to a tenant id known to the policy (or raises ApiError)."""

    def __init__(
        self,
        policy: AuthPolicy,
        keys: VerificationKeys | None,
        tenants: Mapping[str, Any],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._policy = policy
        self._jwt = JwtVerifier(policy.jwt, keys, clock) if policy.jwt and keys else None
        self._tenants = tenants
        header = policy.trusted_tenant_header
        self.trusted_header = header.lower().encode("latin-1") if header else None

    @classmethod
    def from_policy(
        cls,
        policy: AuthPolicy,
        secrets_dir: Path | None,
        tenants: Mapping[str, Any],
        clock: Callable[[], float] = time.time,
    ) -> Authenticator:
        keys = VerificationKeys.load(policy.jwt, secrets_dir) if policy.jwt else None
        return cls(policy, keys, tenants, clock)

    def authenticate(
        self, headers: Mapping[bytes, bytes] | Iterable[tuple[bytes, bytes]]
    ) -> str:
        """`headers` as ASGI gives them (a list of lowercase name/value pairs, where a
        credential sent twice shows) or as a mapping."""
        authorization, trusted = self._credentials(headers)
        if trusted:
            tenant = trusted.decode("latin-1").strip()
            if tenant not in self._tenants:
                raise ApiError(
                    403, UNKNOWN_TENANT,
                    "the tenant named by the trusted tenant header is not configured on "
                    "this pool",
                )
            return tenant
        if authorization is not None and self._jwt is not None:
            tenant = self._jwt.tenant_of(_bearer_token(authorization))
        elif self._policy.anonymous.allowed and self._policy.anonymous.tenant_id:
            # Without JWT configured, a token is ignored: SDKs always send one.
            tenant = self._policy.anonymous.tenant_id
        elif self._jwt is None:
            raise _unauthenticated(
                "this pool accepts neither tokens nor anonymous requests; ask the "
                "platform team to configure auth on the InferencePool", error="",
            )
        else:
            raise _unauthenticated(
                "missing credentials: send 'Authorization: Bearer <JWT>'", error=""
            )
        if tenant not in self._tenants:
            raise ApiError(
                403, UNKNOWN_TENANT,
                f"tenant {tenant[:63]!r} has no TenantQuota on this pool",
            )
        return tenant

    def _credentials(
        self, headers: Mapping[bytes, bytes] | Iterable[tuple[bytes, bytes]]
    ) -> tuple[bytes | None, bytes | None]:
        """The Authorization and trusted tenant header values. A request that names its
        caller twice is refused rather than letting one of the two silently win."""
        authorization: bytes | None = None
        trusted: bytes | None = None
        pairs = headers.items() if isinstance(headers, Mapping) else headers
        for name, value in pairs:
            if name == b"authorization":
                if authorization is not None:
                    raise _duplicate_credentials(
                        "the request has more than one Authorization header; send exactly one"
                    )
                authorization = value
            elif name == self.trusted_header:
                if trusted is not None:
                    raise _duplicate_credentials(
                        "the request has the trusted tenant header more than once; send it "
                        "exactly once"
                    )
                trusted = value
        # Both present is no conflict: the gateway that sets the trusted header may
        # forward the client's own token, and the header (which that gateway owns) wins.
        return authorization, trusted


def _duplicate_credentials(message: str) -> ApiError:
    return ApiError(400, INVALID_REQUEST, message)


def _bearer_token(value: bytes) -> str:
    scheme, _, token = value.decode("latin-1").strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise _unauthenticated(
            "malformed Authorization header: expected 'Bearer <JWT>'", error="invalid_request"
        )
    return token
