"""`kvquota sidecar`: the admission gateway in the engine pod, in front of vLLM.

Client port: POST /v1/completions, POST /v1/chat/completions (streamed through
untouched), GET /v1/models, /healthz (alive), /readyz (engine answers, valid policy,
tokenizer). Admin port: GET /kvquota/status (`SidecarStatus`, polled by the operator),
/metrics, /healthz, /readyz with its reasons.

Refusals are OpenAI-style `{"error": {"message", "type", "code", "param"}}`:
401 UNAUTHENTICATED, 403 UNKNOWN_TENANT, 400 PROMPT_TOO_LONG / INVALID_REQUEST /
REQUEST_EXCEEDS_TENANT_QUOTA, 408 REQUEST_TIMEOUT, 413 REQUEST_TOO_LARGE,
431 REQUEST_HEADERS_TOO_LARGE, 429 TENANT_BLOCK_QUOTA_EXHAUSTED /
TENANT_CONCURRENCY_EXHAUSTED (Retry-After), 503 KV_CACHE_WATERMARK_EXCEEDED
(Retry-After) / ENGINE_UNAVAILABLE / POLICY_NOT_LOADED / SIDECAR_NOT_READY,
502 UPSTREAM_ERROR, 504 UPSTREAM_TIMEOUT.

Modules, one responsibility each: `app` (the routes; `Gateway` wires the parts below),
`config` (`GatewayConfig`), `intake` (policy, authentication, body), `admitter` (count,
queue, decide, rewrite), `relay` (to the engine and back), `passthrough` and
`models_route` (vLLM's other routes), `tokenizer_setup`, `server` (the two ports;
request-head deadline, connection limit), `request_body` (body cap and deadline),
`model_names` (no server paths in /v1/models), `auth` (JWT, keys), `active_policy`
(validated policy + secrets, the plugin's copy), `policy_source` (file poll, ConfigMap
watch), `openai_request` (parse/rewrite bodies), `tokens` (prompt counting),
`admission` (pure decisions), `ledger` (reservations), `forward` + `upstream_http`
(streaming proxy), `engine_auth` (vLLM's API key), `engine_monitor`, `engine_stats`,
`metrics`, `status`, `errors`, `observer` (the hooks a request's steps call) and
`tracing` (OpenTelemetry spans through them, only with an OTLP endpoint set). Calls go
one way: the gateway calls its parts, never the reverse.
"""
