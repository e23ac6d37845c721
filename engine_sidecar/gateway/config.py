"""The gateway's settings (`kvquota sidecar` fills them from its flags and environment)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from engine_sidecar.gateway.auth.engine_key import EngineKey
from engine_sidecar.gateway.intake.body import BODY_BYTES_PER_TOKEN
from engine_sidecar.gateway.relay.affinity import engine_namespace
from engine_sidecar.gateway.telemetry.observer import Observer
from engine_sidecar.gateway.telemetry.tracing import observer_from_env


@dataclass
class GatewayConfig:
    upstream: str = "http://127.0.0.1:8001"
    secrets_dir: Path | None = None
    pool_store_secrets_dir: Path | None = None  # the store password's own Secret, mounted
    plugin_policy_path: Path | None = None  # KVQUOTA_POLICY_PATH: the plugin reads it
    stats_path: Path | None = None  # KVQUOTA_STATS_PATH: the plugin writes it
    tokenizer: str | None = None  # None: the engine's model, then the policy's model
    engine_tokenizer: bool = False  # count with the engine's /tokenize only
    tokenizer_workers: int = 1  # processes tokenizing long prompts (`token_pool`)
    request_timeout: float = 600.0
    connect_timeout: float = 5.0
    retry_after_seconds: int = 1
    max_body_bytes: int = 32 * 1024 * 1024  # global cap; a tenant's is derived below it
    body_bytes_per_token: int = BODY_BYTES_PER_TOKEN  # raise it for image/audio inputs
    body_timeout: float = 30.0  # seconds to receive a whole request body, then 408
    tenant_label_limit: int = 100
    engine_probe_interval: float = 2.0
    extra_request_drop: set[bytes] = field(default_factory=set)
    engine_id: str | None = None  # POD_NAME: the engine a leased session returns to
    # POD_NAMESPACE: with engine_id, the pod a picker's session token names (`affinity`)
    engine_namespace: str | None = field(default_factory=engine_namespace)
    data_plane: str = "auto"  # "httptools" (fast), "httpx" (fallback), "auto"
    engine_key: EngineKey | None = None  # vLLM's --api-key, sent upstream (`auth.engine_key`)
    # Hears each generation request's steps (`observer`): OpenTelemetry spans when an
    # OTLP endpoint is configured (`tracing`), else nothing.
    observer: Observer = field(default_factory=observer_from_env)
