"""`kvquota sidecar`: the admission gateway in the engine pod, in front of vLLM.

It authenticates each generation request, counts the KV blocks it will hold, admits it
under its tenant's quota (or queues or refuses it), and streams it to the engine and
back. The folders follow that way: `intake` (policy, caller, body), `counting` (prompt
tokens), `admission` (decide and reserve), `relay` (to the engine and back); beside
them `upstream` (HTTP clients, engine health), `pool` (the pool-wide store), `policy`,
`telemetry` and `auth`. The top holds the app (`app`), its two servers (`server`),
`config` and `errors`. Calls go one way: the gateway calls its parts, never the
reverse. Routes, refusal codes and why each part is built as it is: docs/gateway.md.
"""
