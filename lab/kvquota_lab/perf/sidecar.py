"""Latency the sidecar adds: `python -m kvquota_lab.perf.sidecar`.

Streams the same requests straight to an upstream and through a sidecar in front of
it, at 1, 16, 64 and 256 concurrent streams, and prints p50/p99 of time to first byte
(TTFT) and total time for both, and the difference.

Upstreams:
- a local streaming stub (always): fixed TTFT, fixed chunk cadence, ~vLLM-sized SSE
  chunks. Its latency is constant, so the difference isolates the sidecar's cost.
  `--pace fast` (default) answers as fast as the flags say (20 ms TTFT, a chunk every
  2 ms): 256 streams then offer several times what one engine serves. `--pace engine`
  sets, before each row, the TTFT and inter-token time an engine of the twin's
  profile (`--profile`, default a100-llama3-8b) has at that row's concurrency
  (`engine_pace`), then adds a saturation row with the fast stub: requests/s per
  sidecar core.
- a real vLLM engine (`--engine-url URL`, or `--model PATH` to start a CPU one):
  shows the overhead against real engine variance.

Every process (stub, sidecar, engine) runs separately from the load generator, which
speaks raw HTTP/1.1 over asyncio streams to keep its own overhead out of the numbers.
Each stream alternates direct and proxied requests, so both see the same machine and
engine state (a paired design: drift and noise from a shared machine cancel out).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import re
import secrets
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kvquota_lab.percentile import percentile
from kvquota_lab.processes import (
    ManagedProcess,
    ProcessFailed,
    cpu_seconds,
    free_port,
    with_children,
)
from kvquota_lab.stack import Processes

CONCURRENCY = (1, 16, 64, 256)


# ---------------------------------------------------------------- stub engine

@dataclass(frozen=True)
class Pace:
    """The stub's delays, ms: before the first chunk, then between chunks."""

    ttft_ms: float
    interval_ms: float


def engine_pace(profile: Any, streams: int, prompt_tokens: int, chunks: int) -> Pace:
    """The twin's step cost (`bench.cost.CostProfile`) at `streams` concurrent requests.

    Inter-token time: one decode step of every stream, each attending its prompt and
    half its output on average. TTFT: the step that prefills the prompt beside the
    other streams' decodes (no queueing before it: the bench's streams all fit)."""
    context = streams * (prompt_tokens + chunks // 2)
    interval = profile.step_seconds(0, streams, context)
    ttft = profile.step_seconds(prompt_tokens, max(0, streams - 1), context)
    return Pace(ttft * 1000, interval * 1000)


def stub_app(ttft_ms: float, chunks: int, interval_ms: float, jitter: float = 0.0,
             tokenizer: str | None = None, memo: bool = False,
             max_model_len: int = 4096) -> Any:
    """A raw ASGI app answering like vLLM's streaming completions.

    POST /bench/pace {"ttft_ms", "interval_ms"} changes its delays (`--pace engine`
    sets them before each row).

    With `jitter`, each delay is drawn from [1 - jitter, 1 + jitter] x its mean (seeded).
    The default is fixed delays, so the upstream's own latency is a constant and the
    difference between direct and proxied runs is the sidecar's; the load generator's
    think time keeps streams out of lockstep."""
    rng = random.Random(0)
    pace = Pace(ttft_ms, interval_ms)
    tokenize = _stub_tokenizer(tokenizer, memo)
    chunk = json.dumps({"id": "cmpl-bench", "object": "text_completion", "created": 0,
                        "model": "stub", "choices": [{"index": 0, "text": " token",
                                                      "logprobs": None,
                                                      "finish_reason": None}]})
    event = b"data: " + chunk.encode() + b"\n\n"
    models = json.dumps({"object": "list", "data": [
        {"id": "stub", "root": "stub", "max_model_len": max_model_len}]}).encode()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        nonlocal pace
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        path = scope["path"]
        if path == "/bench/pace":
            pace = Pace(**json.loads(body))
            path = "/health"
        if path in ("/health", "/v1/models", "/tokenize"):
            payload = models if path == "/v1/models" else (
                tokenize(body) if path == "/tokenize" else b"{}")
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": payload})
            return
        await asyncio.sleep(pace.ttft_ms / 1000 * rng.uniform(1 - jitter, 1 + jitter))
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
        for i in range(chunks):
            if i:
                await asyncio.sleep(pace.interval_ms / 1000
                                    * rng.uniform(1 - jitter, 1 + jitter))
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    return app


def _stub_tokenizer(name: str | None, memo: bool = False) -> Any:
    """The stub's /tokenize: vLLM's answer ({count, tokens, max_model_len}); with a
    tokenizer, its real ids (chat: rendered with its chat template).

    `memo`: each body is answered as the first one of its shape was, the per-request
    number (`UNIQUE`) aside: the same ids, within a token or two of the count, for a few
    us rather than 2.2 ms of rendering (a 2k-token chat). The sidecar's work is the
    same (its cache still misses: every body differs); the stub's core then no longer
    saturates at 64+ streams, which would put the stub's queue into "added"."""
    def rough(body: bytes) -> bytes:
        count = max(1, len(body) // 4)
        return json.dumps({"count": count, "tokens": [7] * count,
                           "max_model_len": 4096}).encode()

    if name is None:
        return rough
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name)

    answers: dict[bytes, bytes] = {}

    def remembered(body: bytes) -> bytes:
        shape = _NUMBERED.sub(b"request", body)
        answer = answers.get(shape)
        if answer is None:
            answer = answers[shape] = real(body)
        return answer

    def real(body: bytes) -> bytes:
        request = json.loads(body)
        if "messages" in request:
            ids = render_chat(tokenizer, request["messages"],
                              request.get("add_generation_prompt", True))
        else:
            ids = tokenizer.backend_tokenizer.encode(request["prompt"]).ids
        return json.dumps({"count": len(ids), "tokens": list(ids),
                           "max_model_len": 4096}).encode()

    return remembered if memo else real


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], generation: bool
                ) -> list[int]:
    """A chat prompt's ids as vLLM renders them: the template's text, then encoded."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=generation,
                                         tokenize=False)
    ids: list[int] = tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids
    return ids


def _serve_stub(args: argparse.Namespace) -> int:
    import uvicorn

    uvicorn.run(stub_app(args.ttft_ms, args.chunks, args.interval_ms, args.jitter,
                         args.tokenizer, args.memo, args.max_model_len),
                host="127.0.0.1",
                port=args.port, log_level="warning", access_log=False)
    return 0


def chat_body(tokenizer: str, tokens: int) -> dict[str, Any]:
    """A streaming chat request whose prompt is about `tokens` tokens of the tiny model's
    tokenizer: a system prompt and a user turn of varied words, ending in a line that
    `run_load` makes unique per request (so no cache serves it)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    rng = random.Random(tokens)
    words = "tenant quota cache block lease premium standard free engine answer".split()
    system = "You answer questions about tenant quotas of the KV cache. " * 4
    text: list[str] = []
    while True:
        messages = [{"role": "system", "content": system},
                    {"role": "user", "content": " ".join(text) + "\nrequest #REQ#"}]
        count = len(render_chat(tok, messages, True))
        if count >= tokens:
            return {"model": "stub", "messages": messages, "max_tokens": 16, "stream": True}
        text += [f"{rng.choice(words)}{rng.randrange(1000)}" for _ in range(
            max(1, (tokens - count) // 3))]


# ---------------------------------------------------------------- load generator

@dataclass
class Sample:
    ttft: float
    total: float
    status: int = 200  # any other: a refusal (e.g. 503 TOKENIZER_BUSY), kept out of the times


async def _read_headers(reader: asyncio.StreamReader) -> tuple[int, dict[bytes, bytes]]:
    status_line = await reader.readline()
    if not status_line:
        raise ConnectionError("connection closed before the status line")
    status = int(status_line.split()[1])
    headers: dict[bytes, bytes] = {}
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b""):
            return status, headers
        key, _, value = line.partition(b":")
        headers[key.strip().lower()] = value.strip()


async def _read_body(reader: asyncio.StreamReader, headers: dict[bytes, bytes],
                     start: float) -> float:
    """Consume the body; return the time its first byte arrived."""
    first: float | None = None
    if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
        while True:
            size = int((await reader.readline()).split(b";")[0], 16)
            if size == 0:
                await reader.readline()
                break
            await reader.readexactly(size + 2)
            first = first or time.perf_counter()
    else:
        length = int(headers.get(b"content-length", b"0"))
        if length:
            await reader.readexactly(length)
            first = time.perf_counter()
    return (first or time.perf_counter()) - start


class Connection:
    """One keep-alive HTTP/1.1 connection, one request at a time."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(self, path: str, body: bytes, headers: dict[str, str]) -> Sample:
        """One request; once more on a new connection if the server had just closed the
        kept-alive one (its keep-alive timeout racing this request)."""
        reused = self.writer is not None
        try:
            return await self._request(path, body, headers)
        except (ConnectionError, asyncio.IncompleteReadError):
            if not reused:
                raise
            self.close()
            self.reader = self.writer = None
            return await self._request(path, body, headers)

    async def _request(self, path: str, body: bytes, headers: dict[str, str]) -> Sample:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
            sock = self.writer.get_extra_info("socket")
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        assert self.reader is not None
        head = [f"POST {path} HTTP/1.1", f"Host: {self.host}:{self.port}",
                "Content-Type: application/json", f"Content-Length: {len(body)}",
                *(f"{k}: {v}" for k, v in headers.items()), "", ""]
        start = time.perf_counter()
        self.writer.write("\r\n".join(head).encode() + body)
        status, response_headers = await _read_headers(self.reader)
        ttft = await _read_body(self.reader, response_headers, start)
        total = time.perf_counter() - start
        return Sample(ttft, total, status)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


@dataclass(frozen=True)
class Target:
    url: str
    headers: dict[str, str]


UNIQUE = b"#REQ#"  # in a body: replaced by a number of its own in every request
_NUMBERED = re.compile(rb"request \d+")  # chat_body's last line, UNIQUE replaced
# One sequence for the whole process: no number repeats across rows (concurrency levels,
# warm-ups), so the sidecar's token cache never serves a body it saw in an earlier row.
_NUMBERS = itertools.count()


async def run_load(targets: list[Target], body: bytes, concurrency: int, requests: int,
                   think_ms: float = 0.0, path: str = "/v1/completions"
                   ) -> list[list[Sample]]:
    """`concurrency` closed-loop streams sending `requests` requests per target.

    Each stream alternates between the targets request by request (one keep-alive
    connection to each), so direct and proxied requests see the same engine state at
    the same moment: a paired design that cancels drift and the engine's own regime
    changes. Each stream pauses a random [0, think_ms] before a request (not measured)
    so streams do not run in lockstep."""
    samples: list[list[Sample]] = [[] for _ in targets]
    remaining = requests * len(targets)
    unique = UNIQUE in body
    rng = random.Random(concurrency)

    async def worker(offset: int) -> None:
        nonlocal remaining
        connections = []
        for target in targets:
            parts = urlsplit(target.url)
            connections.append(Connection(parts.hostname or "127.0.0.1", parts.port or 80))
        turn = offset
        try:
            while remaining > 0:
                remaining -= 1
                index = turn % len(targets)
                turn += 1
                # Numbered before the pause: `remaining` moves while this stream sleeps.
                payload = body.replace(UNIQUE, str(next(_NUMBERS)).encode()) if unique else body
                if think_ms:
                    await asyncio.sleep(rng.uniform(0, think_ms) / 1000)
                samples[index].append(await connections[index].request(
                    path, payload, targets[index].headers))
        finally:
            for connection in connections:
                connection.close()

    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return samples


# ---------------------------------------------------------------- processes

@dataclass
class Setup:
    """A run's working directory and the processes started in it (logs there too)."""

    workdir: Path
    procs: Processes = field(default_factory=Processes)

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None,
              cwd: Path | None = None, *, ready: str | None = None,
              timeout: float = 60.0) -> ManagedProcess:
        """Start `argv` (log: `name`.log); with `ready`, wait until that URL answers 200
        (exits the harness with the log's tail if the process dies or stays unready)."""
        proc = self.procs.start(ManagedProcess(name, argv, self.workdir / f"{name}.log",
                                               env or {}, cwd=cwd))
        if ready is not None:
            try:
                proc.wait_http(ready, timeout)
            except ProcessFailed as exc:
                raise SystemExit(str(exc)) from None
        return proc

    def close(self) -> None:
        self.procs.stop_all()


BENCH_TENANT: dict[str, Any] = {
    "tier": "premium", "priority": 0, "guaranteed_blocks": 1_000_000,
    "max_blocks": 1_000_000, "max_tokens": 4096, "default_max_tokens": 16,
}


def _write_policy(workdir: Path, model: str, tenants: dict[str, dict[str, Any]] | None = None
                  ) -> tuple[Path, Path, dict[str, str]]:
    """Policy file, secrets dir and a JWT per tenant (default: one premium "bench")."""
    import jwt

    from engine_sidecar.contract.policy import EnginePolicy

    tenants = tenants or {"bench": BENCH_TENANT}
    secrets_dir = workdir / "secrets"
    secrets_dir.mkdir()
    hs_secret = secrets.token_bytes(32)  # generated per run, never stored in code
    (secrets_dir / "jwt-hs").write_bytes(hs_secret)
    (secrets_dir / "cache-salt").write_bytes(secrets.token_bytes(32))
    policy = EnginePolicy.model_validate({
        "pool": "bench/pool", "model": model, "block_size": 32, "watermark": 0.1,
        "auth": {"jwt": {"key_file": "jwt-hs", "algorithms": ["HS256"],
                         "audience": "bench", "issuer": "bench"}},
        "tenants": {name: {"tenant_id": name, **fields} for name, fields in tenants.items()},
    }).with_version()
    policy_file = workdir / "policy.json"
    policy_file.write_text(policy.to_json())
    tokens = {name: jwt.encode({"tenant_id": name, "aud": "bench", "iss": "bench",
                                "exp": int(time.time()) + 86_400}, hs_secret, algorithm="HS256")
              for name in tenants}
    return policy_file, secrets_dir, tokens


def _start_sidecar(setup: Setup, upstream: str, model: str, tokenizer: str | None,
                   tenants: dict[str, dict[str, Any]] | None = None,
                   code: Path | None = None, cpu: str | None = None,
                   extra: list[str] | None = None
                   ) -> tuple[str, dict[str, str], ManagedProcess]:
    """A `kvquota sidecar` process; `code`: run the sidecar of another source tree
    (e.g. `git archive` of an older commit)."""
    port = free_port()
    home = setup.workdir / f"sidecar-{port}"
    home.mkdir()
    policy_file, secrets_dir, tokens = _write_policy(home, model, tenants)
    argv = [*_pinned(cpu), sys.executable, "-m", "engine_sidecar.cli", "sidecar",
            "--listen", f"127.0.0.1:{port}", "--admin-listen", f"127.0.0.1:{free_port()}",
            "--upstream", upstream,
            "--policy-file", str(policy_file), "--secrets-dir", str(secrets_dir),
            "--log-level", "warning"]
    argv += ["--tokenizer", tokenizer] if tokenizer else ["--engine-tokenizer"]
    argv += extra or []
    env = {"PYTHONPATH": os.pathsep.join([str(code), os.environ.get("PYTHONPATH", "")])
           } if code else None
    proc = setup.start(f"sidecar-{port}", argv, env, cwd=code,  # `-m`: cwd first
                       ready=f"http://127.0.0.1:{port}/readyz", timeout=180)
    return f"http://127.0.0.1:{port}", tokens, proc


def _move_children(pid: int, cpu: str) -> None:
    """Put the sidecar's child processes (its tokenizer workers) on `cpu`: the event
    loop keeps its core, the counting gets another (issue #32, more than one core)."""
    for child in with_children(pid)[1:]:
        os.sched_setaffinity(child, {int(c) for c in cpu.split(",")})


def _pinned(cpu: str | None) -> list[str]:
    return ["taskset", "-c", cpu] if cpu is not None else []


def _start_stub(setup: Setup, args: argparse.Namespace) -> str:
    port = free_port()
    argv = [*_pinned(getattr(args, "others_cpu", None)), sys.executable, "-m",
            "kvquota_lab.perf.sidecar", "serve-stub",
            "--port", str(port), "--ttft-ms", str(args.stub_ttft_ms),
            "--chunks", str(args.stub_chunks), "--interval-ms", str(args.stub_interval_ms),
            "--jitter", str(args.stub_jitter),
            "--max-model-len", str(getattr(args, "stub_max_model_len", 4096))]
    if getattr(args, "stub_tokenizer", None):
        argv += ["--tokenizer", args.stub_tokenizer]
        if getattr(args, "stub_tokenize", "live") == "memo":
            argv.append("--memo")
    setup.start("stub", argv, ready=f"http://127.0.0.1:{port}/health", timeout=60)
    return f"http://127.0.0.1:{port}"


def _start_engine(setup: Setup, model: str) -> str:
    port = free_port()
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048",
            "--block-size", "32", "--disable-log-stats", "--enable-prefix-caching"]
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    setup.start("vllm", argv, env, ready=f"http://127.0.0.1:{port}/health", timeout=600)
    return f"http://127.0.0.1:{port}"


# ---------------------------------------------------------------- measuring

@dataclass
class Row:
    concurrency: int
    direct: list[Sample]
    proxied: list[Sample]
    cpu_us: float | None = None  # sidecar CPU (user + system, with workers) per request
    busy: float | None = None  # sidecar CPU seconds per second of the run: 1.0 = one core
    pace: Pace | None = None  # the stub's delays in this row (`--pace engine`)
    wall: float = 0.0  # seconds the measured run took (both targets)

    def rate(self) -> float:
        """Requests/s through the sidecar in this row."""
        return len(self.proxied) / self.wall if self.wall else 0.0

    def refused(self, target: str) -> int:
        """Answers other than 200 (not in the times: a fast refusal is no latency)."""
        samples = self.direct if target == "direct" else self.proxied
        return sum(1 for s in samples if s.status != 200)

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = {"cpu_us_per_request": self.cpu_us or 0.0,
                                 "sidecar_core_busy": self.busy or 0.0,
                                 "direct_refused": self.refused("direct"),
                                 "sidecar_refused": self.refused("sidecar")}
        for name, samples in (("direct", self.direct), ("sidecar", self.proxied)):
            for metric in ("ttft", "total"):
                values = [getattr(s, metric) * 1000 for s in samples if s.status == 200] or [0.0]
                out[f"{name}_{metric}_p50"] = statistics.median(values)
                out[f"{name}_{metric}_p99"] = percentile(values, 99) or 0.0
        for metric in ("ttft", "total"):
            for q in ("p50", "p99"):
                out[f"added_{metric}_{q}"] = (out[f"sidecar_{metric}_{q}"]
                                              - out[f"direct_{metric}_{q}"])
        return out


async def _measure(direct_url: str, sidecar_url: str, body: bytes, token: str,
                   concurrency: int, requests: int, think_ms: float,
                   sidecar_pid: int | None = None, path: str = "/v1/completions",
                   pace: Pace | None = None) -> Row:
    if pace is not None:
        await _set_pace(direct_url, pace)
    targets = [Target(direct_url, {}), Target(sidecar_url, {"Authorization": f"Bearer {token}"})]
    await run_load(targets, body, concurrency, max(concurrency, 8), think_ms, path)  # warm up
    before = cpu_seconds(with_children(sidecar_pid)) if sidecar_pid else 0.0
    started = time.perf_counter()
    direct, proxied = await run_load(targets, body, concurrency, requests, think_ms, path)
    wall = time.perf_counter() - started
    if not sidecar_pid:
        return Row(concurrency, direct, proxied, pace=pace, wall=wall)
    used = cpu_seconds(with_children(sidecar_pid)) - before
    return Row(concurrency, direct, proxied, used / len(proxied) * 1e6, used / wall, pace,
               wall)


async def _set_pace(stub_url: str, pace: Pace) -> None:
    parts = urlsplit(stub_url)
    connection = Connection(parts.hostname or "127.0.0.1", parts.port or 80)
    try:
        await connection.request("/bench/pace", json.dumps(
            {"ttft_ms": pace.ttft_ms, "interval_ms": pace.interval_ms}).encode(), {})
    finally:
        connection.close()


def _print_table(title: str, rows: list[Row]) -> None:
    print(f"\n{title}")
    print(f"{'streams':>7} {'n':>5} | {'TTFT p50 / p99 (ms)':^35} | {'total p50 / p99 (ms)':^35}"
          f" | sidecar CPU")
    print(f"{'':>7} {'':>5} | {'direct':>10} {'sidecar':>11} {'added':>11} | "
          f"{'direct':>10} {'sidecar':>11} {'added':>11} | us/request  core busy")
    for row in rows:
        s = row.stats()
        cells = []
        for metric in ("ttft", "total"):
            cells.append(
                f"{s[f'direct_{metric}_p50']:5.2f}/{s[f'direct_{metric}_p99']:<5.2f}"
                f"{s[f'sidecar_{metric}_p50']:6.2f}/{s[f'sidecar_{metric}_p99']:<6.2f}"
                f"{s[f'added_{metric}_p50']:+6.2f}/{s[f'added_{metric}_p99']:<+6.2f}")
        cpu = (f"{row.cpu_us:9.0f}  {row.busy:8.0%}" if row.cpu_us is not None
               and row.busy is not None else "        -")
        counts = {t: row.refused(t) for t in ("direct", "sidecar")}
        refused = "".join(f"  {n} {t} answers not 200" for t, n in counts.items() if n)
        pace = (f"  (stub: TTFT {row.pace.ttft_ms:.1f} ms, a token every "
                f"{row.pace.interval_ms:.1f} ms)" if row.pace else "")
        print(f"{row.concurrency:>7} {len(row.proxied):>5} | {cells[0]} | {cells[1]} | {cpu}"
              f"{refused}{pace}")


def saturation(rows: list[Row], limit_ms: float = 1.0) -> str:
    """The fast stub's rows read as capacity: requests/s one sidecar core serves (its CPU
    per request) in the busiest row whose added TTFT p50 stays within `limit_ms`."""
    within = [r for r in rows if r.cpu_us and r.stats()["added_ttft_p50"] <= limit_ms]
    if not within:
        return f"saturation: no row kept added TTFT p50 within {limit_ms:g} ms"
    row = max(within, key=Row.rate)
    assert row.cpu_us is not None
    return (f"saturation: {1e6 / row.cpu_us:,.0f} requests/s per sidecar core "
            f"({row.cpu_us:.0f} us CPU each) at {row.concurrency} streams, "
            f"{row.rate():,.0f} requests/s through the sidecar, added TTFT p50 "
            f"{row.stats()['added_ttft_p50']:+.2f} ms (<= {limit_ms:g} ms)")


def _bench(label: str, direct_url: str, sidecar_url: str, body: dict[str, Any], token: str,
           args: argparse.Namespace, sidecar_pid: int | None = None,
           path: str = "/v1/completions", pace: Callable[[int], Pace] | None = None
           ) -> list[Row]:
    raw = json.dumps(body).encode()
    rows = [asyncio.run(_measure(direct_url, sidecar_url, raw, token, c,
                                 max(args.requests, 4 * c), args.think_ms, sidecar_pid, path,
                                 pace(c) if pace else None))
            for c in args.concurrency]
    _print_table(label, rows)
    return rows


def _run(args: argparse.Namespace) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="kvquota-bench-"))
    setup = Setup(workdir)
    results: dict[str, list[dict[str, float]]] = {}
    if args.pin:
        args.sidecar_cpu, args.others_cpu = args.pin.split(",")
        os.sched_setaffinity(0, {int(args.others_cpu)})  # this load generator
    if args.chat_tokens:
        args.stub_tokenizer = args.stub_tokenizer or args.tokenizer
    try:
        if not args.no_stub:
            stub = _start_stub(setup, args)
            extra = ["--event-loop", args.event_loop] if args.event_loop else []
            sidecar, tokens, proc = _start_sidecar(
                setup, stub, "stub", args.tokenizer, code=args.code, cpu=args.sidecar_cpu,
                extra=extra + list(args.sidecar_arg))
            if args.worker_cpu is not None and proc.pid:
                _move_children(proc.pid, args.worker_cpu)
            token = tokens["bench"]
            path = "/v1/completions"
            if args.chat_tokens:
                body: dict[str, Any] = chat_body(args.tokenizer, args.chat_tokens)
                path = "/v1/chat/completions"
            else:
                body = {"model": "stub", "prompt": args.prompt, "max_tokens": 16,
                        "stream": True}
            fast = Pace(args.stub_ttft_ms, args.stub_interval_ms)
            details = (
                f"; tokenizer: {args.tokenizer or 'engine /tokenize'}; "
                + (f"chat of {args.chat_tokens} tokens (each unique; stub /tokenize "
                   f"{args.stub_tokenize})" if args.chat_tokens
                   else f"prompt {args.prompt[:30]!r}")
                + (f"; sidecar on CPU {args.sidecar_cpu}, the rest on {args.others_cpu}"
                   if args.pin else "") + (f"; sidecar code {args.code}" if args.code else ""))
            if args.pace == "engine":
                from kvquota_lab.bench.cost import load_profile

                profile = load_profile(args.profile)
                prompt_tokens = args.chat_tokens or max(1, len(args.prompt) // 4)
                rows = _bench(
                    f"stub upstream at the pace of {profile.name} ({prompt_tokens} prompt "
                    f"tokens, {args.stub_chunks} chunks){details}",
                    stub, sidecar, body, token, args, proc.pid or 0, path,
                    lambda c: engine_pace(profile, c, prompt_tokens, args.stub_chunks))
                results["stub_engine_pace"] = [r.stats() for r in rows]
            saturation_rows = _bench(
                ("saturation row: fast " if args.pace == "engine" else "")
                + f"stub upstream (TTFT {args.stub_ttft_ms:g} ms, {args.stub_chunks} chunks "
                f"every {args.stub_interval_ms:g} ms){details}",
                stub, sidecar, body, token, args, proc.pid or 0, path,
                (lambda c: fast) if args.pace == "engine" else None)
            print(saturation(saturation_rows))
            results["stub"] = [r.stats() for r in saturation_rows]
        engine = args.engine_url
        if engine is None and args.model:
            engine = _start_engine(setup, args.model)
        if engine:
            import httpx

            model = httpx.get(engine + "/v1/models").json()["data"][0]["id"]
            sidecar, tokens, _ = _start_sidecar(setup, engine, model, args.tokenizer or model)
            token = tokens["bench"]
            body = {"model": model, "prompt": args.prompt, "max_tokens": args.max_tokens,
                    "stream": True, "ignore_eos": True, "temperature": 0}
            rows = _bench(f"vLLM at {engine} (max_tokens {args.max_tokens})",
                          engine, sidecar, body, token, args)
            results["engine"] = [r.stats() for r in rows]
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
        print(f"\nadded = sidecar - direct, same percentile. Logs: {workdir}")
    finally:
        setup.close()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kvquota_lab.perf.sidecar",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    stub = sub.add_parser("serve-stub", help="(internal) run the streaming stub engine")
    stub.add_argument("--port", type=int, required=True)
    stub.add_argument("--ttft-ms", type=float, default=20.0)
    stub.add_argument("--chunks", type=int, default=32)
    stub.add_argument("--interval-ms", type=float, default=2.0)
    stub.add_argument("--jitter", type=float, default=0.0)
    stub.add_argument("--tokenizer", help="answer /tokenize with this tokenizer's ids")
    stub.add_argument("--max-model-len", type=int, default=4096)
    stub.add_argument("--memo", action="store_true",
                      help="answer each body as the first of its shape (`_stub_tokenizer`)")
    stub.set_defaults(func=_serve_stub)
    from kvquota_lab.perf import admission as bench_admission
    from kvquota_lab.perf import huge as bench_huge

    bench_huge.add_parser(sub)
    bench_admission.add_parser(sub)

    parser.add_argument("--engine-url", help="an already running vLLM OpenAI server")
    parser.add_argument("--model", help="start a vLLM CPU engine with this model directory")
    parser.add_argument("--tokenizer", help="tokenizer for the sidecar (default for the stub: "
                                            "the engine's /tokenize; for vLLM: its model)")
    parser.add_argument("--no-stub", action="store_true", help="skip the stub upstream")
    parser.add_argument("--concurrency", type=int, nargs="+", default=list(CONCURRENCY))
    parser.add_argument("--requests", type=int, default=300,
                        help="requests per target and concurrency (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=32, help="for the real engine")
    parser.add_argument("--prompt", default="tenant quota cache block lease premium standard")
    parser.add_argument("--stub-ttft-ms", type=float, default=20.0)
    parser.add_argument("--stub-chunks", type=int, default=32)
    parser.add_argument("--stub-interval-ms", type=float, default=2.0)
    parser.add_argument("--think-ms", type=float, default=10.0,
                        help="random pause in [0, this] before each request, so streams "
                             "do not run in lockstep (default: %(default)s)")
    parser.add_argument("--stub-jitter", type=float, default=0.0,
                        help="stub delays vary by +-this fraction (default: %(default)s)")
    parser.add_argument("--json", help="also write the numbers to this file")
    parser.add_argument("--pin", metavar="SIDECAR_CPU,OTHER_CPU",
                        help="taskset the sidecar (and its workers) to one CPU, the stub and "
                             "this load generator to another, e.g. 0,1")
    parser.add_argument("--chat-tokens", type=int,
                        help="send chat requests of about this many prompt tokens (by the "
                             "--tokenizer, which the stub's /tokenize then uses too), each "
                             "with a unique last line")
    parser.add_argument("--stub-tokenizer", help="the stub's /tokenize tokenizer")
    parser.add_argument("--stub-tokenize", choices=("live", "memo"), default="live",
                        help="live: the stub renders and encodes every /tokenize body "
                             "(2.2 ms of its CPU per 2k-token chat, on the others' core); "
                             "memo: answers each body as the first of its shape, so only "
                             "the sidecar's cost remains (default: %(default)s)")
    parser.add_argument("--pace", choices=("fast", "engine"), default="fast",
                        help="fast: the stub's fixed delays (--stub-ttft-ms, "
                             "--stub-interval-ms); engine: per row, the delays the twin's "
                             "--profile has at that concurrency, then the fast rows as a "
                             "saturation row (default: %(default)s)")
    parser.add_argument("--stub-max-model-len", type=int, default=8192,
                        help="the context the stub reports (default: %(default)s, "
                             "Llama-3-8B's)")
    parser.add_argument("--profile", default="a100-llama3-8b",
                        help="the twin's cost profile for --pace engine (default: "
                             "%(default)s)")
    parser.add_argument("--code", type=Path, help="run the sidecar from this source tree")
    parser.add_argument("--sidecar-arg", action="append", default=[], metavar="ARG",
                        help="one more argument for the sidecar, e.g. "
                             "--sidecar-arg=--tokenizer-workers=2 (repeatable)")
    parser.add_argument("--worker-cpu", metavar="CPUS",
                        help="once the sidecar is up, move its tokenizer workers to these "
                             "CPUs (comma-separated), off the event loop's core")
    parser.add_argument("--event-loop", choices=("auto", "uvloop", "asyncio"),
                        help="the sidecar's --event-loop (default: its own default)")
    parser.set_defaults(func=_run, sidecar_cpu=None, others_cpu=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
