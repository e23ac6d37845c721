"""Sidecar fixtures: keys in a secrets dir, a preloaded tokenizer, and running sidecars.

`sidecar` is one real sidecar per session (uvicorn in a thread) in front of the shared
real vLLM `engine`; each test applies the policy it needs through the polled policy
file, exactly as a ConfigMap update would arrive. `stub_sidecar` builds a sidecar in
front of a recording stub engine for logic tests.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from engine_sidecar.contract.policy import EnginePolicy
from engine_sidecar.gateway.app import Gateway, GatewayConfig
from engine_sidecar.gateway.counting.token_pool import TokenizerPool
from engine_sidecar.gateway.counting.tokens import (
    EngineTokenCounter,
    HfTokenCounter,
    TokenCounter,
    TokenIds,
)
from engine_sidecar.gateway.intake.openai_request import ParsedRequest
from engine_sidecar.gateway.policy.source import FilePolicySource
from engine_sidecar.gateway.server import ADMIN_MAX_CONNECTIONS, ConnectionLimits
from tests.support.redis_server import RedisServer

from .helpers import WAIT, Keys, ServerThread, wait_for, write_policy
from .stub_engine import StubEngine

SEND_BUFFER = 16 * 1024


@pytest.fixture(scope="session")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Keys:
    return Keys(tmp_path_factory.mktemp("secrets")).write()


class RecordingCounter:
    """The sidecar's counter, remembering each request's prompt token counts (tests
    compare them with what the engine reports)."""

    def __init__(self, inner: TokenCounter) -> None:
        self.inner = inner
        self.description = inner.description
        self.longest_token_bytes = inner.longest_token_bytes
        self.pool = inner.pool
        self.counts: list[tuple[int, ...]] = []

    async def tokenize(self, request: ParsedRequest) -> tuple[TokenIds, ...]:
        prompts = await self.inner.tokenize(request)
        self.counts.append(tuple(len(p) for p in prompts))
        return prompts


CounterFactory = Callable[[Gateway], RecordingCounter]


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model: Path) -> Any:
    """The tiny model's tokenizer, as transformers loads it (loaded once)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model))


@pytest.fixture(scope="session")
def tokenizer_pool(tiny_tokenizer: Any) -> Iterator[TokenizerPool]:
    """The sidecar's tokenizer worker processes, started once for the session."""
    pool = TokenizerPool.for_tokenizer(tiny_tokenizer.backend_tokenizer)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def token_counter(
    tiny_model: Path, tiny_tokenizer: Any, tokenizer_pool: TokenizerPool
) -> CounterFactory:
    """The counter `kvquota sidecar` builds: the model's tokenizer, its worker pool,
    chat prompts through the gateway's engine."""
    return lambda gateway: RecordingCounter(HfTokenCounter(
        tiny_tokenizer, str(tiny_model), EngineTokenCounter(gateway.upstream, None),
        tokenizer_pool))


@dataclass
class Harness:
    gateway: Gateway
    policy_file: Path
    server: ServerThread  # the client port
    admin: ServerThread  # status, metrics, probes

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def admin_url(self) -> str:
        return self.admin.url

    @property
    def counter(self) -> RecordingCounter:
        counter = self.gateway.token_counter
        assert isinstance(counter, RecordingCounter)
        return counter

    def stop(self) -> None:
        self.server.stop()
        self.admin.stop()

    def apply(self, policy: EnginePolicy, timeout: float = 10.0) -> EnginePolicy:
        """Publish a policy and wait until the sidecar enforces it."""
        write_policy(self.policy_file, policy)
        wait_for(lambda: self.gateway.holder.active is not None
                 and self.gateway.holder.active.version == policy.version,
                 timeout, f"sidecar did not load policy {policy.version}: "
                          f"{self.gateway.holder.error}")
        return policy

    def ledger_is_empty(self) -> bool:
        ledger = self.gateway.ledger
        return ledger.total_blocks == 0 and ledger.total_inflight == 0 and not ledger.tenants()

    def wait_ledger_empty(self, timeout: float = WAIT) -> bool:
        """The ledger settles when the engine's response ends, which can be a moment
        after a client already holds every byte of a Content-Length response."""
        ledger = self.gateway.ledger
        wait_for(self.ledger_is_empty, timeout,
                 f"ledger not empty: {ledger.total_blocks} blocks, "
                 f"{ledger.total_inflight} in flight")
        return True


def start_harness(
    tmp: Path, config: GatewayConfig, counter: CounterFactory | None,
    limits: ConnectionLimits | None = None, **kwargs: Any,
) -> Harness:
    """Both ports, served as `kvquota sidecar` serves them."""
    limits = limits or ConnectionLimits()
    policy_file = tmp / "policy-source.json"
    gateway = Gateway(config, FilePolicySource(policy_file, interval=0.05), **kwargs)
    if counter is not None:  # before the server starts: the lifespan loads none then
        gateway.token_counter = counter(gateway)
    admin = ServerThread(gateway.admin_app, limits=ConnectionLimits(
        head_timeout=limits.head_timeout, max_connections=ADMIN_MAX_CONNECTIONS),
        lifespan="off").start()
    server = ServerThread(gateway.app, send_buffer=SEND_BUFFER, limits=limits).start()
    return Harness(gateway, policy_file, server, admin)


@pytest.fixture(scope="session")
def sidecar(
    engine: Any, keys: Keys, token_counter: CounterFactory,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Harness]:
    """The real sidecar in front of the real engine; it writes the plugin's policy file."""
    config = GatewayConfig(
        upstream=engine.url, secrets_dir=keys.dir, plugin_policy_path=engine.policy_path,
        stats_path=engine.stats_path, request_timeout=60.0, engine_probe_interval=0.5,
    )
    harness = start_harness(tmp_path_factory.mktemp("sidecar"), config, token_counter)
    try:
        wait_for(lambda: harness.gateway.monitor.up, 30, "sidecar never saw the engine up")
        yield harness
    finally:
        harness.stop()


StubFactory = Callable[..., tuple[Harness, StubEngine]]


@pytest.fixture
def stub_sidecar(
    keys: Keys, token_counter: CounterFactory, tmp_path: Path
) -> Iterator[StubFactory]:
    """Factory: a sidecar in front of a recording stub engine served on a socket."""
    servers: list[ServerThread] = []

    def make(
        stub: StubEngine | None = None, *, wait_up: bool = True,
        limits: ConnectionLimits | None = None, **config: Any,
    ) -> tuple[Harness, StubEngine]:
        stub = stub or StubEngine()
        stub_server = ServerThread(stub).start()
        servers.append(stub_server)
        settings = {"upstream": stub_server.url, "secrets_dir": keys.dir,
                    "plugin_policy_path": tmp_path / "plugin-policy.json",
                    "engine_probe_interval": 0.2, **config}
        harness = start_harness(tmp_path, GatewayConfig(**settings), token_counter, limits)
        servers.extend((harness.admin, harness.server))
        if wait_up:
            wait_for(lambda: harness.gateway.monitor.up, WAIT, "stub engine not seen up")
        return harness, stub

    yield make
    for server in reversed(servers):
        server.stop()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of the test's own on a free port, killed at the end."""
    srv = RedisServer(tmp_path)
    srv.start()
    yield srv
    srv.kill()
