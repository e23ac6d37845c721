"""Latency the sidecar adds: `python -m kvquota_lab.perf.sidecar`.

Streams the same requests straight to an upstream and through a sidecar in front of
it, at 1, 16, 64 and 256 concurrent streams, and prints p50/p99 of time to first byte
(TTFT) and total time for both, and the difference. Per row also: the sidecar's CPU per
request (its process and workers, user + system, over the proxied requests) and how
many requests it admitted on their prompts' ceiling (counted after forwarding) and
counted before admission (its /metrics). Beside the table, per row, where a tail comes
from: the sidecar's event-loop lag (percentiles of a 5 ms ticker's oversleep; the ticks
late by 2 ms or more split into GC, other work on the loop's thread and time off the
CPU, i.e. other processes on its core) and its GC pauses per generation
(`telemetry.pause_probe`, enabled through `$KVQUOTA_PAUSE_PROBE`).

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
import json
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from engine_sidecar.gateway.telemetry.pause_probe import (
    INTERVAL_S,
    LATE_MS,
    WRITE_EVERY_S,
    PauseSnapshot,
)
from kvquota_lab.percentile import percentile
from kvquota_lab.perf import admission as bench_admission
from kvquota_lab.perf import huge as bench_huge
from kvquota_lab.perf import pool_store as bench_pool_store
from kvquota_lab.perf import relay as bench_relay
from kvquota_lab.perf.launch import Setup, move_children, start_engine, start_sidecar, start_stub
from kvquota_lab.perf.load import Connection, Sample, Target, run_load
from kvquota_lab.perf.stub import Pace, chat_body, engine_pace, serve
from kvquota_lab.processes import cpu_seconds, free_port, with_children

CONCURRENCY = (1, 16, 64, 256)


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
    # Admitted requests of the measured run: on their prompts' ceiling (counted after
    # forwarding), and counted before admission (None: the sidecar does not say).
    on_ceiling: int | None = None
    counted_first: int | None = None
    # The sidecar's event-loop lag and GC pauses over the measured run (None: no probe).
    pauses: PauseSnapshot | None = None

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
                                 "admitted_on_ceiling": float(self.on_ceiling or 0),
                                 "admitted_counted_first": float(self.counted_first or 0),
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
        if self.pauses is not None:
            out.update(pause_stats(self.pauses))
        return out


LAG_LATE_MS = 5.0  # a tick this late held every stream in flight for as long: counted


def pause_stats(pauses: PauseSnapshot) -> dict[str, float]:
    """The loop-lag percentiles (bucket edges, ms), late ticks, and GC per generation."""
    lag = pauses.lag
    events = [ms for _t, kind, ms in pauses.events if kind == "lag"]
    out = {f"loop_lag_{name}_ms": lag.quantile(q) or 0.0
           for name, q in (("p50", 0.5), ("p99", 0.99), ("p999", 0.999))}
    out["loop_lag_max_ms"] = max(events, default=lag.quantile(1.0) or 0.0)
    out["loop_ticks"] = float(lag.n)
    out["loop_ticks_late"] = float(lag.over(LAG_LATE_MS))
    late = pauses.late
    out.update({"late_ticks": float(late.n), "late_lag_ms": late.lag_ms,
                "late_gc_ms": late.gc_ms, "late_other_cpu_ms": late.cpu_ms - late.gc_ms,
                "late_off_cpu_ms": late.off_cpu_ms})
    for generation, hist in pauses.gc.items():
        gc_events = [ms for _t, kind, ms in pauses.events if kind == f"gc{generation}"]
        out[f"gc{generation}_count"] = float(hist.n)
        out[f"gc{generation}_total_ms"] = hist.total_ms
        out[f"gc{generation}_max_ms"] = max(gc_events, default=hist.quantile(1.0) or 0.0)
        cpu = pauses.gc_cpu[generation]
        out[f"gc{generation}_cpu_total_ms"] = cpu.total_ms
        out[f"gc{generation}_cpu_max_ms"] = cpu.quantile(1.0) or 0.0
    return out


async def _measure(direct_url: str, sidecar_url: str, body: bytes, token: str,
                   concurrency: int, requests: int, think_ms: float,
                   sidecar_pid: int | None = None, path: str = "/v1/completions",
                   pace: Pace | None = None, admin_url: str | None = None,
                   pause_probe: Path | None = None) -> Row:
    if pace is not None:
        await _set_pace(direct_url, pace)
    targets = [Target(direct_url, {}), Target(sidecar_url, {"Authorization": f"Bearer {token}"})]
    await run_load(targets, body, concurrency, max(concurrency, 8), think_ms, path)  # warm up
    admissions = await admission_counts(admin_url) if admin_url else None
    pauses_before = await _fresh_pauses(pause_probe)
    before = cpu_seconds(with_children(sidecar_pid)) if sidecar_pid else 0.0
    started = time.perf_counter()
    direct, proxied = await run_load(targets, body, concurrency, requests, think_ms, path)
    wall = time.perf_counter() - started
    pauses_after = await _fresh_pauses(pause_probe)
    pauses = (pauses_after.since(pauses_before)
              if pauses_before is not None and pauses_after is not None else None)
    if not sidecar_pid:
        return Row(concurrency, direct, proxied, pace=pace, wall=wall, pauses=pauses)
    used = cpu_seconds(with_children(sidecar_pid)) - before
    row = Row(concurrency, direct, proxied, used / len(proxied) * 1e6, used / wall, pace,
              wall, pauses=pauses)
    if admin_url and admissions is not None:
        ceiling, admitted = (after - before for after, before in zip(
            await admission_counts(admin_url), admissions, strict=True))
        if not math.isnan(ceiling):
            row.on_ceiling, row.counted_first = round(ceiling), round(admitted - ceiling)
    return row


async def _fresh_pauses(path: Path | None) -> PauseSnapshot | None:
    """The probe's snapshot once it has rewritten its file (it does every 0.25 s): the
    difference of two spans the measured run and at most that much either side."""
    if path is None:
        return None
    await asyncio.sleep(WRITE_EVERY_S * 1.5)
    return PauseSnapshot.read(path)


CEILING_METRIC = "kvquota_ceiling_admissions_total"
ADMITTED = 'decision="admitted"'


async def admission_counts(admin_url: str) -> tuple[float, float]:
    """(requests admitted on their prompts' ceiling, requests admitted) so far, from the
    sidecar's /metrics; the first is NaN for a sidecar without that metric (`--code`)."""
    parts = urlsplit(admin_url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    try:
        writer.write(f"GET /metrics HTTP/1.1\r\nHost: {parts.netloc}\r\n"
                     "Connection: close\r\n\r\n".encode())
        text = (await reader.read()).decode()
    finally:
        writer.close()
    ceiling, admitted, seen = 0.0, 0.0, False
    for line in text.splitlines():
        if line.startswith(CEILING_METRIC):
            ceiling += float(line.rsplit(" ", 1)[1])
            seen = True
        elif line.startswith("kvquota_admissions_total{") and ADMITTED in line:
            admitted += float(line.rsplit(" ", 1)[1])
    return (ceiling if seen else math.nan), admitted


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
          f" | sidecar CPU          | admitted")
    print(f"{'':>7} {'':>5} | {'direct':>10} {'sidecar':>11} {'added':>11} | "
          f"{'direct':>10} {'sidecar':>11} {'added':>11} | us/request  core busy | "
          f"ceiling / counted first")
    for row in rows:
        s = row.stats()
        cells = []
        for metric in ("ttft", "total"):
            cells.append(
                f"{s[f'direct_{metric}_p50']:5.2f}/{s[f'direct_{metric}_p99']:<5.2f}"
                f"{s[f'sidecar_{metric}_p50']:6.2f}/{s[f'sidecar_{metric}_p99']:<6.2f}"
                f"{s[f'added_{metric}_p50']:+6.2f}/{s[f'added_{metric}_p99']:<+6.2f}")
        cpu = (f"{row.cpu_us:9.0f}  {row.busy:8.0%}" if row.cpu_us is not None
               and row.busy is not None else f"{'-':>9}  {'-':>8}")
        cpu += (f" | {row.on_ceiling:7d} / {row.counted_first:<7d}"
                if row.on_ceiling is not None and row.counted_first is not None
                else f" | {'-':>7} / {'-':<7}")
        counts = {t: row.refused(t) for t in ("direct", "sidecar")}
        refused = "".join(f"  {n} {t} answers not 200" for t, n in counts.items() if n)
        pace = (f"  (stub: TTFT {row.pace.ttft_ms:.1f} ms, a token every "
                f"{row.pace.interval_ms:.1f} ms)" if row.pace else "")
        print(f"{row.concurrency:>7} {len(row.proxied):>5} | {cells[0]} | {cells[1]} | {cpu}"
              f"{refused}{pace}")
    _print_pauses(rows)


def _print_pauses(rows: list[Row]) -> None:
    """Beside the latency table: the sidecar's event-loop lag and GC pauses per row."""
    if not any(row.pauses for row in rows):
        return
    print(f"the sidecar's event loop (a {INTERVAL_S * 1000:g} ms ticker's oversleep; uvloop's "
          f"timers are ms-grained) and GC pauses, same rows:")
    print(f"{'streams':>7} | {'loop lag p50/p99/p99.9/max (ms)':^31} | late>{LAG_LATE_MS:g}ms "
          f"| ticks late>{LATE_MS:g}ms: lag ms = GC + other CPU + off CPU "
          f"| GC gen0 / gen1 / gen2: n, total ms, max ms (its CPU: max ms, bucket edge)")
    for row in rows:
        if row.pauses is None:
            print(f"{row.concurrency:>7} | (no probe)")
            continue
        s = pause_stats(row.pauses)
        gens = " / ".join(f"{s[f'gc{g}_count']:.0f}, {s[f'gc{g}_total_ms']:.0f}, "
                          f"{s[f'gc{g}_max_ms']:.1f} ({s[f'gc{g}_cpu_max_ms']:.1f})"
                          for g in range(3))
        print(f"{row.concurrency:>7} | {s['loop_lag_p50_ms']:5.2f} {s['loop_lag_p99_ms']:6.2f} "
              f"{s['loop_lag_p999_ms']:6.2f} {s['loop_lag_max_ms']:7.1f}    | "
              f"{s['loop_ticks_late']:6.0f}/{s['loop_ticks']:<6.0f} | "
              f"{s['late_lag_ms']:7.0f} = {s['late_gc_ms']:5.0f} + "
              f"{s['late_other_cpu_ms']:6.0f} + {s['late_off_cpu_ms']:6.0f}{'':>8} | {gens}")


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
           path: str = "/v1/completions", pace: Callable[[int], Pace] | None = None,
           admin_url: str | None = None, pause_probe: Path | None = None) -> list[Row]:
    raw = json.dumps(body).encode()
    rows = [asyncio.run(_measure(direct_url, sidecar_url, raw, token, c,
                                 max(args.requests, 4 * c), args.think_ms, sidecar_pid, path,
                                 pace(c) if pace else None, admin_url, pause_probe))
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
            stub = start_stub(setup, args)
            extra = ["--event-loop", args.event_loop] if args.event_loop else []
            admin_port = free_port()
            admin = f"http://127.0.0.1:{admin_port}"
            probe = None if args.no_pause_probe else workdir / "pauses.json"
            sidecar, tokens, proc = start_sidecar(
                setup, stub, "stub", args.tokenizer, code=args.code, cpu=args.sidecar_cpu,
                extra=extra + list(args.sidecar_arg), admin_port=admin_port,
                pause_probe=probe)
            if args.worker_cpu is not None and proc.pid:
                move_children(proc.pid, args.worker_cpu)
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
                    lambda c: engine_pace(profile, c, prompt_tokens, args.stub_chunks), admin,
                    probe)
                results["stub_engine_pace"] = [r.stats() for r in rows]
            saturation_rows = _bench(
                ("saturation row: fast " if args.pace == "engine" else "")
                + f"stub upstream (TTFT {args.stub_ttft_ms:g} ms, {args.stub_chunks} chunks "
                f"every {args.stub_interval_ms:g} ms){details}",
                stub, sidecar, body, token, args, proc.pid or 0, path,
                (lambda c: fast) if args.pace == "engine" else None, admin, probe)
            print(saturation(saturation_rows))
            results["stub"] = [r.stats() for r in saturation_rows]
        engine = args.engine_url
        if engine is None and args.model:
            engine = start_engine(setup, args.model)
        if engine:
            import httpx

            model = httpx.get(engine + "/v1/models").json()["data"][0]["id"]
            sidecar, tokens, _ = start_sidecar(setup, engine, model, args.tokenizer or model)
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
    stub.set_defaults(func=serve)
    bench_huge.add_parser(sub)
    bench_admission.add_parser(sub)
    bench_relay.add_parser(sub)
    bench_pool_store.add_parser(sub)

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
    parser.add_argument("--no-pause-probe", action="store_true",
                        help="do not measure the sidecar's event-loop lag and GC pauses "
                             "(its probe: a ticker task and a gc callback, "
                             "$KVQUOTA_PAUSE_PROBE)")
    parser.add_argument("--event-loop", choices=("auto", "uvloop", "asyncio"),
                        help="the sidecar's --event-loop (default: its own default)")
    parser.set_defaults(func=_run, sidecar_cpu=None, others_cpu=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "chat_tokens", None) and not getattr(args, "tokenizer", None):
        parser.error("--chat-tokens needs --tokenizer: a local tokenizer directory (the tiny "
                     "model's, say) whose chat template builds the prompts")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
