"""Session-wide fixtures: the tiny model and one real vLLM CPU engine with the plugin.

Heavy things are made once per test session; the model is cached across sessions in
`.cache/` (or `$KVQUOTA_TEST_CACHE`).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvquota_lab.processes import EngineOptions, ManagedProcess, free_port, vllm_engine

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("KVQUOTA_TEST_CACHE", REPO / ".cache"))


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from kvquota_lab.tinymodel import generate

    return generate(CACHE / "tiny-model")


@dataclass(frozen=True)
class Engine:
    """A running vLLM OpenAI server (CPU) with TenantAwareScheduler loaded.

    Write an EnginePolicy JSON to `policy_path` (atomically) to change its policy;
    the plugin publishes its stats at `stats_path`.
    """

    url: str
    model: Path
    policy_path: Path
    stats_path: Path
    block_size: int
    process: ManagedProcess


@contextmanager
def _serve(model: Path, run_dir: Path, **options: Any) -> Iterator[Engine]:
    opts = EngineOptions(
        model=model,
        port=free_port(),
        policy_path=run_dir / "policy.json",
        stats_path=run_dir / "stats.json",
        **options,
    )
    proc = vllm_engine(opts, run_dir / "vllm.log").start()
    try:
        url = f"http://127.0.0.1:{opts.port}"
        proc.wait_http(url + "/health", timeout=240)
        yield Engine(url, model, opts.policy_path, opts.stats_path, opts.block_size, proc)
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def serve_engine(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[..., AbstractContextManager[Engine]]:
    """Start another engine for as long as a `with` block: `serve_engine(**EngineOptions
    overrides)`. Scope it to the module that needs it."""
    return lambda **options: _serve(tiny_model, tmp_path_factory.mktemp("engine"), **options)


SERVED_MODEL_NAME = "tiny"  # the test policies' pool model (`spec.model`)


@pytest.fixture(scope="session")
def engine(
    serve_engine: Callable[..., AbstractContextManager[Engine]], tiny_model: Path,
) -> Iterator[Engine]:
    # vLLM's stats on, as deployed: its vllm:* Prometheus series are what routers scrape.
    # It serves the pool's model name, as injection and the demo start it (responses
    # carry the name a client asked for), and the model's path as an alias.
    with serve_engine(log_stats=True, extra_args=[
            "--served-model-name", SERVED_MODEL_NAME, str(tiny_model)]) as running:
        yield running


@pytest.fixture(scope="session")
def vllm_parser() -> argparse.ArgumentParser:
    """vLLM's own `vllm serve` / api_server argument parser (slow to import: once)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())
