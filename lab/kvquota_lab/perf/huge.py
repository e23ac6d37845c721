"""Huge prompts from one tenant, another tenant's TTFT: `python -m kvquota_lab.perf.sidecar
huge-prompts`.

A sidecar with the tiny model's tokenizer in front of the streaming stub (TTFT 20 ms).
Tenant "victim" (premium) sends a short prompt at a steady rate (open loop, Poisson
arrivals); its TTFT, from each request's scheduled moment, is measured twice: alone,
then while tenant "attacker" (free; a quota whose body cap lets 10 MB through,
`maxPromptTokens` 4096) sends 10 MB completion prompts of varied words back to back
from a process of its own. Each phase runs for `--seconds`; the victim's requests
still in flight at the end are waited for and counted.

`--code DIR` runs the sidecar from another source tree, e.g. the commit before the
worker pool:  git archive 97affd7 | tar -x -C /tmp/kvq-old; ... --code /tmp/kvq-old
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from kvquota_lab.percentile import percentile
from kvquota_lab.perf.launch import BENCH_TENANT, Setup, start_sidecar, start_stub
from kvquota_lab.perf.load import Connection, Sample
from kvquota_lab.processes import memory_kb, with_children

VICTIM_BODY = {"model": "stub", "prompt": "tenant quota cache block lease premium standard",
               "max_tokens": 16, "stream": True}
ATTACKER = {"tier": "free", "priority": 2, "guaranteed_blocks": 0, "max_blocks_per_engine": 8192,
            "max_tokens": 64, "default_max_tokens": 16, "max_prompt_tokens": 4096}
TOKEN_ENV = "KVQUOTA_BENCH_TOKEN"  # the attacker's JWT (not on its command line)
WORDS = "tenant quota cache block lease premium standard free engine scheduler".split()


def varied_text(size: int, seed: int = 0) -> str:
    """Words with numbers in random order: the tokenizer's word cache rarely helps."""
    rng = random.Random(seed)
    parts, length = [], 0
    while length < size:
        word = f"{rng.choice(WORDS)}{rng.randrange(100_000)} "
        parts.append(word)
        length += len(word)
    return "".join(parts)[:size]


# ---------------------------------------------------------------- the attacker process

def _attack(args: argparse.Namespace) -> int:
    """(Its own process.) Send `--bytes` prompts on `--connections` connections until
    SIGTERM; then print one JSON line: requests answered, by status, mean seconds."""
    body = json.dumps({"model": "stub", "prompt": varied_text(args.bytes),
                       "max_tokens": 16}).encode()
    host, port = args.host, args.port
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Authorization: Bearer {os.environ[TOKEN_ENV]}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    stop = threading.Event()
    statuses: dict[str, int] = {}
    times: list[float] = []
    first: dict[str, str] = {}  # status -> the first answer's start (what refused it)

    def one() -> None:
        while not stop.is_set():
            started = time.monotonic()
            try:
                with socket.create_connection((host, port), timeout=300) as sock:
                    sock.sendall(head + body)
                    answer = b""
                    while chunk := sock.recv(65536):  # the sidecar closes after answering
                        answer += chunk
                    status = answer.split(b" ", 2)[1].decode()
                    first.setdefault(status, answer.split(b"\r\n\r\n", 1)[-1][:300].decode(
                        errors="replace"))
            except OSError as exc:
                status = type(exc).__name__
            statuses[status] = statuses.get(status, 0) + 1
            times.append(time.monotonic() - started)

    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    threads = [threading.Thread(target=one, daemon=True) for _ in range(args.connections)]
    for thread in threads:
        thread.start()
    print("started", flush=True)
    while not stop.is_set():
        time.sleep(0.1)
    print(json.dumps({"statuses": statuses, "answered": len(times), "first": first,
                      "mean_s": statistics.mean(times) if times else None}), flush=True)
    return 0


# ---------------------------------------------------------------- the victim

async def _victim(url: str, token: str, rate: float, seconds: float) -> list[Sample]:
    """Open-loop arrivals: `rate` requests per second for `seconds`, each sent at its
    scheduled moment whatever the earlier ones are doing, its TTFT counted from that
    moment (a closed loop would stop sending while the sidecar stalls and miss the
    stall: coordinated omission). Requests in flight at the end are waited for."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    body = json.dumps(VICTIM_BODY).encode()
    headers = {"Authorization": f"Bearer {token}"}
    idle: list[Connection] = []
    samples: list[Sample] = []
    rng = random.Random(int(rate))

    async def one(scheduled: float) -> None:
        connection = idle.pop() if idle else Connection(parts.hostname or "127.0.0.1",
                                                        parts.port or 80)
        sample = await connection.request("/v1/completions", body, headers)
        late = time.perf_counter() - sample.total - scheduled  # sent after its moment
        samples.append(Sample(sample.ttft + late, sample.total + late))
        idle.append(connection)

    tasks = []
    start = time.perf_counter()
    moment = start
    while moment < start + seconds:
        moment += rng.expovariate(rate)
        await asyncio.sleep(max(0.0, moment - time.perf_counter()))
        tasks.append(asyncio.create_task(one(moment)))
    await asyncio.gather(*tasks)
    for connection in idle:
        connection.close()
    return samples


def _summary(samples: list[Sample]) -> dict[str, float]:
    ttft = [s.ttft * 1000 for s in samples]
    return {"n": len(ttft), "p50": statistics.median(ttft), "p99": percentile(ttft, 99) or 0.0,
            "max": max(ttft)}


def run(args: argparse.Namespace) -> int:
    setup = Setup(Path(tempfile.mkdtemp(prefix="kvquota-bench-huge-")))
    try:
        stub = start_stub(setup, args)
        sidecar, tokens, proc = start_sidecar(
            setup, stub, "stub", args.tokenizer,
            tenants={"victim": BENCH_TENANT, "attacker": ATTACKER}, code=args.code)
        asyncio.run(_victim(sidecar, tokens["victim"], args.rate, 2.0))  # warm up
        alone = asyncio.run(_victim(sidecar, tokens["victim"], args.rate, args.seconds))
        port = sidecar.rsplit(":", 1)[1]
        attacker = setup.start("attacker", [
            sys.executable, "-m", "kvquota_lab.perf.huge", "--host", "127.0.0.1",
            "--port", port, "--bytes", str(args.bytes),
            "--connections", str(args.connections)], {TOKEN_ENV: tokens["attacker"]})
        while "started" not in attacker.log_path.read_text():
            time.sleep(0.1)
        attacked = asyncio.run(_victim(sidecar, tokens["victim"], args.rate, args.seconds))
        attacker.stop(grace=600)  # SIGTERM: the attacker prints its report and exits
        report = json.loads(attacker.log_path.read_text().splitlines()[-1])
        # peak resident memory of the sidecar and its tokenizer workers
        rss = memory_kb(with_children(proc.pid or 0), "VmHWM") / 1024
    finally:
        setup.close()
    base, hit = _summary(alone), _summary(attacked)
    code = args.code or "this tree"
    print(f"\nsidecar from {code}; tokenizer {args.tokenizer}; victim: {args.rate:g} "
          f"requests/s (Poisson), {args.seconds:g} s per phase; attacker: "
          f"{args.bytes / 1e6:g} MB prompts on {args.connections} connection(s)")
    print(f"{'victim TTFT (ms)':<28} {'n':>6} {'p50':>9} {'p99':>9} {'max':>9}")
    for name, row in (("alone", base), ("while attacked", hit)):
        print(f"{name:<28} {row['n']:>6.0f} {row['p50']:>9.2f} {row['p99']:>9.2f} "
              f"{row['max']:>9.2f}")
    print(f"p99 attacked / alone: {hit['p99'] / base['p99']:.2f}x (target <= 1.2x)")
    print(f"attacker: {report['answered']} answered {report['statuses']}, mean "
          f"{report['mean_s'] or 0:.2f} s each; sidecar peak RSS (with workers) "
          f"{rss:.0f} MB")
    for status, answer in report["first"].items():
        print(f"  first {status}: {answer}")
    if args.json:
        Path(args.json).write_text(json.dumps({"alone": base, "attacked": hit,
                                               "attacker": report, "peak_rss_mb": rss}))
    return 0


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("huge-prompts", help="another tenant's TTFT under 10 MB prompts",
                            description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", required=True, help="the sidecar's --tokenizer")
    parser.add_argument("--code", type=Path, help="run the sidecar from this source tree")
    parser.add_argument("--bytes", type=int, default=10_000_000)
    parser.add_argument("--connections", type=int, default=1)
    parser.add_argument("--rate", type=float, default=40.0,
                        help="victim requests per second (default: %(default)s)")
    parser.add_argument("--seconds", type=float, default=20.0, help="per phase")
    parser.add_argument("--stub-ttft-ms", type=float, default=20.0)
    parser.add_argument("--stub-chunks", type=int, default=32)
    parser.add_argument("--stub-interval-ms", type=float, default=2.0)
    parser.add_argument("--stub-jitter", type=float, default=0.0)
    parser.add_argument("--json", help="also write the numbers to this file")
    parser.set_defaults(func=run)


def main() -> int:
    parser = argparse.ArgumentParser(description="(internal) the huge-prompt attacker")
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--bytes", type=int, required=True)
    parser.add_argument("--connections", type=int, default=1)
    return _attack(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
