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

The token names the engine that keeps the session's KV, which is not always one where
its next turn fits: a picker that weighs the token above its load scorers (the example
configuration: 3 against 1 + 1) sends the session back to queue on its tenant's
per-engine ceiling there. So the token is sent only while the tenant's charge on this
engine (this turn's included) leaves room below its maxBlocks here for the next turns
of the sessions it has already called back (those between turns, each at least its
lease's size) and about one more turn of this one (`admission.call_back.calls_back`: this turn's own
blocks again): each token is a promise of room, and several sessions that were each
told there is room for one more turn come back together. Otherwise the response
clears it, so the picker's other scorers decide the next turn: the header
goes out empty (the scorer scores no pod for an empty token; a client that echoes the
last token it was given stops naming this pod) and the cookie is expired
(`llm-d-session=; Max-Age=0`, the standard way to delete a cookie, which a client that
keeps cookies honours by dropping it). In the cookie version the scorer sets the
cookie itself after each response only when the request's cookie does not already
name the pod it picked, so a cleared cookie stays cleared until the picker, on its
own scores, picks another pod. The lease hint still names the lease's engine: it says
where the KV is, for routers that weigh that themselves.
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
