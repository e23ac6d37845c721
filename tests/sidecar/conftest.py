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

from engine_sidecar.gateway.app import Gateway, GatewayConfig
from engine_sidecar.gateway.policy_source import FilePolicySource
from engine_sidecar.gateway.tokens import HfTokenCounter, TokenCounter
from engine_sidecar.policy import EnginePolicy

from .helpers import Keys, ServerThread, wait_for, write_policy
from .stub_engine import StubEngine

SEND_BUFFER = 16 * 1024


@pytest.fixture(scope="session")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Keys:
    return Keys(tmp_path_factory.mktemp("secrets")).write()


@pytest.fixture(scope="session")
def token_counter(tiny_model: Path) -> TokenCounter:
    return HfTokenCounter.load(str(tiny_model))


@dataclass
class Harness:
    gateway: Gateway
    policy_file: Path
    server: ServerThread

    @property
    def url(self) -> str:
        return self.server.url

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

    def wait_ledger_empty(self, timeout: float = 5.0) -> bool:
        """The ledger settles when the engine's response ends, which can be a moment
        after a client already holds every byte of a Content-Length response."""
        ledger = self.gateway.ledger
        wait_for(self.ledger_is_empty, timeout,
                 f"ledger not empty: {ledger.total_blocks} blocks, "
                 f"{ledger.total_inflight} in flight")
        return True


def start_harness(
    tmp: Path, config: GatewayConfig, counter: TokenCounter | None, **kwargs: Any
) -> Harness:
    policy_file = tmp / "policy-source.json"
    gateway = Gateway(config, FilePolicySource(policy_file, interval=0.05),
                      token_counter=counter, **kwargs)
    server = ServerThread(gateway.app, send_buffer=SEND_BUFFER).start()
    return Harness(gateway, policy_file, server)


@pytest.fixture(scope="session")
def sidecar(
    engine: Any, keys: Keys, token_counter: TokenCounter,
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
        harness.server.stop()


StubFactory = Callable[..., tuple[Harness, StubEngine]]


@pytest.fixture
def stub_sidecar(
    keys: Keys, token_counter: TokenCounter, tmp_path: Path
) -> Iterator[StubFactory]:
    """Factory: a sidecar in front of a recording stub engine served on a socket."""
    servers: list[ServerThread] = []

    def make(
        stub: StubEngine | None = None, *, wait_up: bool = True, **config: Any
    ) -> tuple[Harness, StubEngine]:
        stub = stub or StubEngine()
        stub_server = ServerThread(stub).start()
        servers.append(stub_server)
        settings = {"upstream": stub_server.url, "secrets_dir": keys.dir,
                    "plugin_policy_path": tmp_path / "plugin-policy.json",
                    "engine_probe_interval": 0.2, **config}
        harness = start_harness(tmp_path, GatewayConfig(**settings), token_counter)
        servers.append(harness.server)
        if wait_up:
            wait_for(lambda: harness.gateway.monitor.up, 10, "stub engine not seen up")
        return harness, stub

    yield make
    for server in reversed(servers):
        server.stop()
