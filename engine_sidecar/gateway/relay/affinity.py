"""Session affinity in the form the shipped endpoint pickers already honour.

On the response head of an admitted request of a leased session, the sidecar names the
engine that keeps the session's KV: `x-session-token` (base64 of `<namespace>/<pod>`,
Go's StdEncoding), which llm-d's `session-affinity-scorer` scores 1, the cookie
`llm-d-session` that earlier versions of that scorer read, and
`x-kvquota-lease-engine: <pod>` for routers that match the plain name.

The token is a promise of room: it is sent only while the tenant's charge here leaves
room below its maxBlocks for the sessions already called back plus one more turn of
this one (`admission.call_back`); otherwise the header goes out empty and the cookie is
expired. Which scorer versions read what, and why: docs/gateway.md (relay).
"""

from __future__ import annotations

import base64
import os

from engine_sidecar.contract.names import ENGINE_NAMESPACE_ENV

LEASE_ENGINE_HEADER = b"x-kvquota-lease-engine"
SESSION_TOKEN_HEADER = b"x-session-token"
SESSION_COOKIE = "llm-d-session"


def engine_namespace() -> str | None:
    """The engine pod's namespace from its environment (None outside a pod)."""
    return os.environ.get(ENGINE_NAMESPACE_ENV) or None


def session_token(namespace: str, pod: str) -> str:
    """The picker's session token for the pod `namespace/pod`."""
    return base64.b64encode(f"{namespace}/{pod}".encode()).decode("ascii")




def affinity_headers(pod: str | None, namespace: str | None, *, call_back: bool = True
                     ) -> list[tuple[bytes, bytes]]:
    """Response headers for a leased session on `pod`: the lease hint with the pod's
    name, and, once its namespace is known too, the picker's session token as a header
    and as a cookie; with `call_back` False the token is cleared in both forms instead
    (the session's next turn does not fit here). Empty for an unnamed engine."""
    if not pod:
        return []
    headers = [(LEASE_ENGINE_HEADER, pod.encode())]
    if namespace:
        token = session_token(namespace, pod) if call_back else ""
        expiry = "" if call_back else "Max-Age=0; "
        headers.append((SESSION_TOKEN_HEADER, token.encode()))
        headers.append((b"set-cookie", f"{SESSION_COOKIE}={token}; Path=/; {expiry}"
                                       "HttpOnly; SameSite=Lax".encode()))
    return headers
