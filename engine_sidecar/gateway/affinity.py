"""Session affinity in the form the shipped endpoint pickers already honour.

llm-d's `session-affinity-scorer` (llm-d/llm-d-inference-scheduler,
pkg/plugins/scorer/session_affinity.go, since moved to
pkg/epp/framework/plugins/scheduling/scorer/sessionaffinity/session_affinity.go) scores
1 the pod named by the request header `x-session-token`, whose value is the pod's
`<namespace>/<name>` in standard, padded base64 (Go's base64.StdEncoding), and 0 every
other pod. Between those two versions the same scorer read the same value from the
cookie `llm-d-session` instead (pkg/plugins/scorer/session_affinity.go at llm-d
commit 0b592cd3), set with `Path=/; HttpOnly; SameSite=Lax`.

The sidecar sends both on the response head of every admitted request of a session
whose tenant has leases, naming the engine that will keep the session's KV pinned:
a client that echoes the header, or keeps cookies, brings the session's next turn
back to that pod through the picker's own scorer, with configuration only. Only the
engine's sidecar knows a lease lives there; the picker's scorer, where it writes the
token itself, does so at the end of the response (after a stream's head has gone out)
and for every request, leased or not. `x-kvquota-lease-engine: <pod>` stays beside
them for routers that match a header on the pod's plain name.
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


def affinity_headers(pod: str | None, namespace: str | None) -> list[tuple[bytes, bytes]]:
    """Response headers that bring a leased session back to `pod`: the lease hint with
    the pod's name, and, once its namespace is known too, the picker's session token as
    a header and as a cookie. Empty for an unnamed engine."""
    if not pod:
        return []
    headers = [(LEASE_ENGINE_HEADER, pod.encode())]
    if namespace:
        token = session_token(namespace, pod)
        headers.append((SESSION_TOKEN_HEADER, token.encode()))
        headers.append((b"set-cookie", f"{SESSION_COOKIE}={token}; Path=/; HttpOnly; "
                                       "SameSite=Lax".encode()))
    return headers
