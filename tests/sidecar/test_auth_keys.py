"""Key loading and token verification, without a server.

The auth matrix against the real engine is in test_engine_contract.py; these cover the
key formats and refusals a platform team can misconfigure.
"""

from __future__ import annotations

import datetime
import logging
import secrets
from pathlib import Path
from typing import Any

import jwt
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.x509.oid import NameOID

from engine_sidecar.contract.policy import AuthPolicy
from engine_sidecar.gateway.auth.callers import Authenticator, KeyFileError
from engine_sidecar.gateway.errors import ApiError

from .helpers import AUDIENCE, ISSUER, JWKS_FILE, Keys, hs_forged_with, unsigned_token

TENANTS = {"acme": object(), "anon": object(), "gw": object()}


def _auth(keys: Keys, **jwt_fields: Any) -> Authenticator:
    fields = {"key_file": "jwt-hs", "algorithms": ["HS256"], "issuer": ISSUER,
              "audience": AUDIENCE, "leeway_seconds": 5, **jwt_fields}
    return Authenticator.from_policy(AuthPolicy.model_validate({"jwt": fields}), keys.dir,
                                     TENANTS)


def _tenant(auth: Authenticator, token: str | None, **headers: str) -> str:
    raw = {k.replace("_", "-").lower().encode(): v.encode() for k, v in headers.items()}
    if token is not None:
        raw[b"authorization"] = f"Bearer {token}".encode()
    return auth.authenticate(raw)


def _refused(auth: Authenticator, token: str | None, status: int = 401, **headers: str) -> str:
    with pytest.raises(ApiError) as info:
        _tenant(auth, token, **headers)
    assert info.value.status == status
    return info.value.message


def test_hs256_verifies_and_checks_time_and_audience(keys: Keys) -> None:
    auth = _auth(keys)
    assert _tenant(auth, keys.hs("acme")) == "acme"
    assert _tenant(auth, keys.hs("acme", exp=keys.claims()["iat"] - 2)) == "acme"  # leeway
    assert "expired" in _refused(auth, keys.hs("acme", exp=keys.claims()["iat"] - 60))
    assert "not valid yet" in _refused(auth, keys.hs("acme", nbf=keys.claims()["iat"] + 60))
    assert "audience" in _refused(auth, keys.hs("acme", aud="someone-else"))
    assert "issuer" in _refused(auth, keys.hs("acme", iss="https://evil.test"))
    assert "'exp'" in _refused(auth, jwt.encode({"tenant_id": "acme", "iss": ISSUER,
                                                 "aud": AUDIENCE}, keys.hs_secret))


def test_hs_pool_refuses_none_public_key_tokens_and_wrong_secrets(keys: Keys) -> None:
    auth = _auth(keys)
    assert "'none'" in _refused(auth, unsigned_token(keys.claims()))
    assert "'RS256'" in _refused(auth, keys.rs("acme"))
    forged = jwt.encode(keys.claims(), b"x" * 32, algorithm="HS256")
    assert "signature" in _refused(auth, forged)


def test_rs_pool_refuses_hs_tokens_signed_with_its_public_key(keys: Keys) -> None:
    auth = _auth(keys, key_file="jwt-rsa.pem", algorithms=["RS256"])
    assert _tenant(auth, keys.rs("acme")) == "acme"
    assert "'HS256'" in _refused(auth, hs_forged_with(keys.rsa_public_pem(), keys.claims()))
    assert "'ES256'" in _refused(auth, keys.es("acme"))


def test_jwks_selects_by_kid_and_key_type(keys: Keys) -> None:
    auth = _auth(keys, key_file=JWKS_FILE, algorithms=["RS256", "ES256"])
    assert _tenant(auth, keys.rs("acme", kid="rsa-1")) == "acme"
    assert _tenant(auth, keys.es("acme", kid="ec-1")) == "acme"
    assert _tenant(auth, keys.es("acme")) == "acme"  # no kid: every EC key is tried
    assert "no configured key" in _refused(auth, keys.rs("acme", kid="retired"))


def test_certificates_and_private_keys_yield_public_keys(
    keys: Keys, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "idp")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(keys.rsa.public_key()).serial_number(1)
            .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
            .sign(keys.rsa, hashes.SHA256()))
    (keys.dir / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (keys.dir / "private.pem").write_bytes(keys.rsa.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    assert _tenant(_auth(keys, key_file="cert.pem", algorithms=["RS256"]),
                   keys.rs("acme")) == "acme"
    with caplog.at_level(logging.WARNING):
        auth = _auth(keys, key_file="private.pem", algorithms=["RS256"])
    assert _tenant(auth, keys.rs("acme")) == "acme"
    assert "public half" in caplog.text and "PRIVATE" not in caplog.text


@pytest.mark.parametrize(("key_file", "algorithms", "message"), [
    ("jwt-rsa.pem", ["HS256"], "holds a PEM key"),
    ("jwt-ec.pem", ["RS256"], "no key usable"),
    ("jwt-ec.pem", ["ES384"], "no key usable"),
    ("jwt-hs", ["RS256"], "not a readable PEM"),
    ("short-hs", ["HS256"], "at least 32"),
    ("missing", ["HS256"], "not found"),
    ("../jwt-hs", ["HS256"], "plain file name"),
])
def test_misconfigured_keys_are_refused_with_a_fix(
    keys: Keys, key_file: str, algorithms: list[str], message: str
) -> None:
    (keys.dir / "short-hs").write_bytes(b"too-short")
    with pytest.raises(KeyFileError, match=message) as info:
        _auth(keys, key_file=key_file, algorithms=algorithms)
    assert keys.hs_secret.hex() not in str(info.value)


def test_tenant_claim_rules(keys: Keys) -> None:
    nested = _auth(keys, tenant_claim="org.tenant")
    assert _tenant(nested, keys.hs(None, org={"tenant": "acme"})) == "acme"
    assert "no string claim" in _refused(nested, keys.hs("acme"), status=403)
    assert "no TenantQuota" in _refused(_auth(keys), keys.hs("stranger"), status=403)


def test_malformed_headers(keys: Keys) -> None:
    auth = _auth(keys)
    for value in ("Basic dXNlcjpwYXNz", "Bearer", "Bearer   ", "token-without-scheme"):
        with pytest.raises(ApiError) as info:
            auth.authenticate({b"authorization": value.encode()})
        assert info.value.status == 401
    assert "well-formed" in _refused(auth, "a.b.c")
    assert "missing credentials" in _refused(auth, None)


def test_anonymous_and_trusted_header(keys: Keys) -> None:
    policy = AuthPolicy.model_validate({
        "jwt": {"key_file": "jwt-hs", "algorithms": ["HS256"]},
        "anonymous": {"allowed": True, "tenant_id": "anon"},
        "trusted_tenant_header": "X-Fairness-Id",
    })
    auth = Authenticator.from_policy(policy, keys.dir, TENANTS)
    assert _tenant(auth, None) == "anon"
    assert _refused(auth, "not-a-jwt")  # a bad token is never downgraded to anonymous
    assert _tenant(auth, None, x_fairness_id="gw") == "gw"
    assert "trusted tenant header" in _refused(auth, None, status=403, x_fairness_id="nobody")

    open_pool = Authenticator.from_policy(AuthPolicy.model_validate(
        {"anonymous": {"allowed": True, "tenant_id": "anon"}}), None, TENANTS)
    assert _tenant(open_pool, "sk-whatever-the-sdk-sends") == "anon"
    closed = Authenticator.from_policy(AuthPolicy(), None, TENANTS)
    assert "neither tokens nor anonymous" in _refused(closed, None)
    assert _refused(closed, None, x_fairness_id="gw")  # header off unless configured


def _clocked(keys: Keys, clock: list[float], **jwt_fields: Any) -> Authenticator:
    fields = {"key_file": "jwt-hs", "algorithms": ["HS256"], "issuer": ISSUER,
              "audience": AUDIENCE, "leeway_seconds": 5, **jwt_fields}
    return Authenticator.from_policy(AuthPolicy.model_validate({"jwt": fields}), keys.dir,
                                     TENANTS, clock=lambda: clock[0])


@pytest.mark.parametrize(("claims", "message"), [
    ({"exp": 10**400}, "'exp' is out of range"),
    ({"exp": 1e308}, "'exp' is out of range"),
    ({"exp": float("inf")}, "'exp' is out of range"),
    ({"exp": float("nan")}, "'exp' is out of range"),
    ({"iat": -(10**30)}, "'iat' is out of range"),
    ({"exp": "4102444800"}, "'exp' must be a JSON number of seconds since the epoch, not a "
                            "string"),
    ({"exp": True}, "'exp' must be a JSON number of seconds since the epoch, not a boolean"),
    ({"nbf": "0"}, "'nbf' must be a JSON number of seconds since the epoch, not a string"),
    ({"iat": [0]}, "'iat' must be a JSON number of seconds since the epoch, not an array"),
])
def test_time_claims_must_be_numbers_in_range(
    keys: Keys, claims: dict[str, Any], message: str
) -> None:
    """Refused with a 401 that names the claim: never an overflow (a 500) and never a
    string that PyJWT would coerce into a date."""
    refusal = _refused(_auth(keys), keys.hs("acme", **claims))
    assert message in refusal


def test_max_token_lifetime_refuses_long_lived_tokens(keys: Keys) -> None:
    now = keys.claims()["iat"]
    capped = _auth(keys, max_token_lifetime_seconds=3600)
    assert _tenant(capped, keys.hs("acme", exp=now + 3000)) == "acme"
    assert "at most 3600 s" in _refused(capped, keys.hs("acme", exp=now + 7200))
    assert "at most 3600 s" in _refused(capped, keys.hs("acme", exp=253_402_300_799))
    old_but_long = keys.hs("acme", iat=now - 7000, exp=now + 300)
    assert "(exp - iat) is 7300 s" in _refused(capped, old_but_long)
    assert _tenant(_auth(keys), old_but_long) == "acme"  # no cap configured: any lifetime


def test_verified_tokens_are_checked_again_within_minutes(
    keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A token valid until the year 9999 is not trusted from the cache until then."""
    decoded: list[str] = []
    decode = jwt.decode

    def counting(token: str, *args: Any, **kwargs: Any) -> Any:
        decoded.append(token)
        return decode(token, *args, **kwargs)

    monkeypatch.setattr(jwt, "decode", counting)
    clock = [float(keys.claims()["iat"])]
    auth = _clocked(keys, clock)
    token = keys.hs("acme", exp=253_402_300_799)
    assert _tenant(auth, token) == "acme"
    clock[0] += 60
    assert _tenant(auth, token) == "acme"
    assert len(decoded) == 1  # the cache answered
    clock[0] += 600
    assert _tenant(auth, token) == "acme"
    assert len(decoded) == 2  # verified again


def test_expired_tokens_leave_the_cache(keys: Keys) -> None:
    clock = [float(keys.claims()["iat"])]
    auth = _clocked(keys, clock)
    token = keys.hs("acme", exp=int(clock[0]) + 30)
    assert _tenant(auth, token) == "acme"
    clock[0] += 40  # past exp + 5 s leeway
    assert "expired" in _refused(auth, token)


def test_a_caller_named_twice_is_a_bad_request(keys: Keys) -> None:
    policy = AuthPolicy.model_validate({
        "jwt": {"key_file": "jwt-hs", "algorithms": ["HS256"]},
        "trusted_tenant_header": "X-Fairness-Id",
    })
    auth = Authenticator.from_policy(policy, keys.dir, TENANTS)
    acme, gw = (f"Bearer {keys.hs(t)}".encode() for t in ("acme", "gw"))
    cases = [
        ([(b"authorization", acme), (b"authorization", gw)], "more than one Authorization"),
        ([(b"x-fairness-id", b"gw"), (b"x-fairness-id", b"acme")], "more than once"),
    ]
    for headers, message in cases:
        with pytest.raises(ApiError) as info:
            auth.authenticate(headers)
        assert (info.value.status, info.value.code) == (400, "INVALID_REQUEST")
        assert message in info.value.message
    assert auth.authenticate([(b"authorization", gw), (b"user-agent", b"sdk")]) == "gw"
    # A gateway that sets the trusted header may forward the client's token: its header,
    # the one it owns, names the tenant.
    assert auth.authenticate([(b"authorization", acme), (b"x-fairness-id", b"gw")]) == "gw"

    # Without JWT the Authorization header is no credential (SDKs always send one).
    gateway_only = Authenticator.from_policy(AuthPolicy.model_validate(
        {"trusted_tenant_header": "X-Fairness-Id"}), None, TENANTS)
    assert gateway_only.authenticate(
        [(b"authorization", b"Bearer sk-anything"), (b"x-fairness-id", b"gw")]) == "gw"


@pytest.mark.parametrize("ending", [b"\n", b"\r\n"])
def test_a_binary_secret_ending_in_a_newline_byte_is_used_whole(
    tmp_path: Path, ending: bytes
) -> None:
    """`head -c 32 /dev/urandom` ends in a newline byte about once in 128 files; the
    secret must stay whole, or every token signed with it is refused (and a 32-byte
    secret read as 31 is refused as too short)."""
    keys = Keys(tmp_path, hs_secret=b"\x00\xff" + secrets.token_bytes(30) + ending).write()
    assert _tenant(_auth(keys), keys.hs("acme")) == "acme"


def test_a_text_secret_written_with_echo_loses_its_newline(tmp_path: Path) -> None:
    text = secrets.token_hex(32).encode()
    keys = Keys(tmp_path, hs_secret=text).write()
    (keys.dir / "jwt-hs").write_bytes(text + b"\n")
    assert _tenant(_auth(keys), keys.hs("acme")) == "acme"
