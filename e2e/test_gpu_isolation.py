"""Noisy neighbour on a real GPU: premium multi-turn chats keep their time to first
token while the free tier floods the same engine, and only the free tier is refused.

Needs the cluster from e2e/setup.sh (kind, one GPU worker, the operator, the sample
pool and tenants, one vLLM engine behind the KVQuota sidecar). Skipped without it.
Every loop here is bounded by a count and a deadline.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import jwt
import pytest

NAMESPACE = os.environ.get("KVQUOTA_E2E_NAMESPACE", "default")
SERVICE = os.environ.get("KVQUOTA_E2E_SERVICE", "vllm-engine")
KEY_FILE = Path(os.environ.get("KVQUOTA_E2E_JWT_KEY", Path(__file__).parent / ".work/jwt.key"))

PREMIUM_SESSIONS = 4        # concurrent premium conversations
TURNS = 5                   # turns per conversation
THINK_SECONDS = 2.0         # a user reading the answer between turns
FREE_WORKERS = 32           # parallel free-tier clients, each looping
FREE_PROMPT_WORDS = 900     # ~1,200 tokens: long, under the sample free cap of 1,536
RUN_DEADLINE = 600.0        # seconds, for one whole premium run
TTFT_FACTOR = 2.0           # loaded p99 may be at most this times the unloaded p99 ...
TTFT_SLACK = 0.25           # ... or the unloaded p99 plus this many seconds, if larger


def _kubectl(*args: str, timeout: float = 20) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["kubectl", *args], capture_output=True, text=True, timeout=timeout)


def _why_not_runnable() -> str | None:
    if shutil.which("kubectl") is None:
        return "kubectl is not installed"
    if not os.environ.get("KUBECONFIG") and not (Path.home() / ".kube" / "config").exists():
        return "no cluster configured (no KUBECONFIG, no ~/.kube/config): run e2e/setup.sh"
    try:
        if _kubectl("cluster-info").returncode != 0:
            return "no cluster reachable (`kubectl cluster-info` failed): run e2e/setup.sh"
        nodes = _kubectl("get", "nodes", "-o", "json")
    except subprocess.TimeoutExpired:
        return "the cluster does not answer within 20 s"
    allocatable = [
        int(n["status"].get("allocatable", {}).get("nvidia.com/gpu", "0"))
        for n in json.loads(nodes.stdout or '{"items": []}')["items"]
    ]
    if not any(allocatable):
        return "no node with allocatable nvidia.com/gpu (NVIDIA device plugin installed?)"
    if _kubectl("-n", NAMESPACE, "get", "service", SERVICE).returncode != 0:
        return f"service {NAMESPACE}/{SERVICE} not found: run e2e/setup.sh"
    if not KEY_FILE.is_file():
        return f"{KEY_FILE} (the JWT signing key setup.sh makes) not found"
    return None


_reason = _why_not_runnable()
if _reason:
    pytest.skip(_reason, allow_module_level=True)


# ------------------------------------------------------------------ cluster facts


def _get(kind: str) -> list[dict[str, Any]]:
    out = _kubectl("-n", NAMESPACE, "get", kind, "-o", "json")
    assert out.returncode == 0, out.stderr
    items: list[dict[str, Any]] = json.loads(out.stdout)["items"]
    return items


@dataclass(frozen=True)
class Setup:
    model: str
    premium_token: str
    free_token: str


@pytest.fixture(scope="module")
def setup() -> Setup:
    (pool,) = _get("inferencepools.kvquota.dev")
    quotas = _get("tenantquotas.kvquota.dev")
    auth = pool["spec"]["auth"]["jwt"]
    key = KEY_FILE.read_text()

    def token(tier: str) -> str:
        quota = next(q for q in quotas if q["spec"]["tier"] == tier)
        tenant = quota["spec"].get("tenantId") or quota["metadata"]["name"]
        now = int(time.time())
        claims = {auth.get("tenantClaim", "tenant_id"): tenant, "sub": f"e2e-{tier}",
                  "iat": now, "exp": now + 3600}
        if auth.get("issuer"):
            claims["iss"] = auth["issuer"]
        if auth.get("audience"):
            claims["aud"] = auth["audience"]
        return jwt.encode(claims, key, algorithm=auth["algorithms"][0])

    return Setup(model=pool["spec"]["model"], premium_token=token("premium"),
                 free_token=token("free"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    port = _free_port()
    forward = subprocess.Popen(
        ["kubectl", "-n", NAMESPACE, "port-forward", f"service/{SERVICE}", f"{port}:8000"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert forward.poll() is None, f"port-forward exited: {forward.stderr.read()}"
            assert time.monotonic() < deadline, "the sidecar did not become ready in 60 s"
            time.sleep(1)
        yield url
    finally:
        forward.terminate()
        forward.wait(timeout=10)


# ------------------------------------------------------------------ the workload


WORDS = ("kernel cache tenant block prefix engine token quota lease batch request "
         "scheduler memory latency priority premium stream decode prefill").split()


def _text(words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


@dataclass
class Tally:
    ttfts: list[float] = field(default_factory=list)
    statuses: list[int] = field(default_factory=list)


async def _chat(client: httpx.AsyncClient, token: str, body: dict[str, Any],
                session: str | None = None) -> tuple[int, float | None, str]:
    """(status, seconds to the first streamed chunk, answer text)."""
    headers = {"authorization": f"Bearer {token}"}
    if session:
        headers["x-session-id"] = session
    started = time.monotonic()
    ttft, answer = None, []
    async with client.stream("POST", "/v1/chat/completions", json=body,
                             headers=headers) as response:
        if response.status_code != 200:
            await response.aread()
            return response.status_code, None, ""
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ttft = ttft if ttft is not None else time.monotonic() - started
            for choice in json.loads(line[6:]).get("choices", []):
                answer.append(choice.get("delta", {}).get("content") or "")
    return 200, ttft, "".join(answer)


async def _premium_conversation(client: httpx.AsyncClient, setup: Setup, index: int,
                                run: str, tally: Tally) -> None:
    messages = [{"role": "system", "content": "Answer briefly. Reference notes: "
                 + _text(900, seed=index)}]
    for turn in range(TURNS):
        messages.append({"role": "user", "content": f"Question {turn}: {_text(30, turn)}"})
        status, ttft, answer = await _chat(
            client, setup.premium_token,
            {"model": setup.model, "messages": messages, "max_tokens": 48, "stream": True,
             "temperature": 0},
            session=f"e2e-{run}-{index}",
        )
        tally.statuses.append(status)
        if ttft is not None:
            tally.ttfts.append(ttft)
        messages.append({"role": "assistant", "content": answer})
        await asyncio.sleep(THINK_SECONDS)


async def _free_flood(client: httpx.AsyncClient, setup: Setup, worker: int,
                      stop: asyncio.Event, tally: Tally) -> None:
    for n in range(10_000):
        if stop.is_set():
            return
        body = {"model": setup.model, "max_tokens": 512, "stream": True,
                "messages": [{"role": "user", "content": _text(FREE_PROMPT_WORDS,
                                                               seed=worker * 10_000 + n)}]}
        try:
            status, _, _ = await _chat(client, setup.free_token, body)
        except httpx.TransportError:
            status = 0
        tally.statuses.append(status)
        if status != 200:
            await asyncio.sleep(0.2)  # honour back-pressure a little, keep the pressure on


async def _scenario(base_url: str, setup: Setup, *, noisy: bool) -> tuple[Tally, Tally]:
    premium, free = Tally(), Tally()
    limits = httpx.Limits(max_connections=FREE_WORKERS + PREMIUM_SESSIONS + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as client:
        stop = asyncio.Event()
        flood = [asyncio.create_task(_free_flood(client, setup, w, stop, free))
                 for w in range(FREE_WORKERS if noisy else 0)]
        if noisy:
            await asyncio.sleep(10)  # let the flood fill the KV cache first
        run = "noisy" if noisy else "quiet"
        try:
            await asyncio.wait_for(asyncio.gather(*(
                _premium_conversation(client, setup, i, run, premium)
                for i in range(PREMIUM_SESSIONS)
            )), timeout=RUN_DEADLINE)
        finally:
            stop.set()
            for task in flood:
                task.cancel()
            await asyncio.gather(*flood, return_exceptions=True)
    return premium, free


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def test_premium_ttft_holds_while_free_tier_floods(base_url: str, setup: Setup) -> None:
    # Warm-up: the first request after start compiles kernels; not part of the baseline.
    asyncio.run(_scenario(base_url, setup, noisy=False))
    quiet, _ = asyncio.run(_scenario(base_url, setup, noisy=False))
    noisy, free = asyncio.run(_scenario(base_url, setup, noisy=True))

    assert set(quiet.statuses) == {200}
    assert set(noisy.statuses) == {200}, "premium requests must never be refused"
    assert len(noisy.ttfts) == PREMIUM_SESSIONS * TURNS

    refused = [s for s in free.statuses if s in (429, 503)]
    assert refused, "the free tier's flood was never refused (429/503)"
    assert set(free.statuses) <= {200, 429, 503}, f"free tier got {set(free.statuses)}"

    baseline, loaded = _p99(quiet.ttfts), _p99(noisy.ttfts)
    budget = max(TTFT_FACTOR * baseline, baseline + TTFT_SLACK)
    print(f"premium TTFT p99: quiet {baseline:.3f}s, under flood {loaded:.3f}s "
          f"(budget {budget:.3f}s); free tier: {len(free.statuses)} requests, "
          f"{len(refused)} refused")
    assert loaded <= budget
