"""CPU of one admission decision: `python -m kvquota_lab.perf.sidecar admission`.

A request's admission decision (authentication, token count, queueing;
not the time spent waiting in the queue) should cost at most 200 us of sidecar CPU for
a 2k-token chat. This runs the sidecar's own request path in this process (the
`Gateway` of `app.py`, with the tiny model's tokenizer loaded as `--tokenizer` would),
against the streaming stub in a process of its own, whose /tokenize answers with the
tokenizer's real ids (as vLLM's does; the stub's rendering time is the stub's CPU, not
counted here). Each request is a unique chat of about `--chat-tokens` tokens, sent one
at a time, so no cache helps.

Measured per request with the thread's CPU clock (`time.thread_time`: this thread runs
the event loop; the stub's CPU is in another process): the whole decision, from the
policy lookup and JWT check through parsing, vetting, the /tokenize exchange (encode,
send, read, parse the answer), block fingerprints, the queue's decision and
reservation, to the rewritten body that would be forwarded. Printed: p50, mean and p90
over `--requests`; then each stage alone, on the same bodies, so the total can be read
as its parts. `--profile` prints the cProfile of the whole decisions instead.
`--tenants N` puts N - 1 idle tenants beside the bench's own in the policy: the queue's
decision should not grow with them (`admission.pool_view` holds only the tenants that
hold something).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from engine_sidecar.gateway import server
from kvquota_lab.percentile import percentile
from kvquota_lab.perf.launch import BENCH_TENANT, Setup, start_stub, write_policy
from kvquota_lab.perf.load import UNIQUE
from kvquota_lab.perf.stub import chat_body, render_chat


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("admission", help="CPU of one admission decision",
                            description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", required=True,
                        help="the model's tokenizer (e.g. the tiny model's directory)")
    parser.add_argument("--chat-tokens", type=int, default=2000)
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--tenants", type=int, default=1,
                        help="tenants in the policy: the bench's own plus idle ones, each "
                             "with a guarantee (default: %(default)s)")
    parser.add_argument("--pin", metavar="THIS_CPU,STUB_CPU",
                        help="taskset this process to one CPU and the stub to another")
    parser.add_argument("--event-loop", choices=("auto", "uvloop", "asyncio"),
                        default="auto", help="as the sidecar's --event-loop")
    parser.add_argument("--near-limit", action="store_true",
                        help="give the bench's tenant a maxBlocks the chat fits only at its "
                             "exact count, not at its ceiling: the path that counts first")
    parser.add_argument("--profile", action="store_true",
                        help="print the cProfile of the decisions (slower; no table)")
    parser.add_argument("--stub-max-model-len", type=int, default=8192,
                        help="the context the stub reports (default: %(default)s, "
                             "Llama-3-8B's)")
    parser.set_defaults(func=_run, stub_ttft_ms=20.0, stub_chunks=1, stub_interval_ms=1.0,
                        stub_jitter=0.0)


def _us(samples: list[float]) -> str:
    p50, p90 = percentile(samples, 50) or 0.0, percentile(samples, 90) or 0.0
    return (f"p50 {p50 * 1e6:7.0f}  mean "
            f"{statistics.fmean(samples) * 1e6:7.0f}  p90 {p90 * 1e6:7.0f}")


async def _never() -> dict[str, Any]:
    await asyncio.Event().wait()
    return {"type": "http.disconnect"}


async def _cpu(step: Callable[[int], Awaitable[object]], count: int) -> list[float]:
    samples = []
    for i in range(count):
        start = time.thread_time()
        await step(i)
        samples.append(time.thread_time() - start)
    return samples


async def _measure(args: argparse.Namespace, upstream: str, workdir: Path) -> None:
    from engine_sidecar.gateway.admission.rules import RequestShape
    from engine_sidecar.gateway.app import Gateway, GatewayConfig
    from engine_sidecar.gateway.counting.prefix import prompt_fingerprints
    from engine_sidecar.gateway.intake.openai_request import Kind, parse
    from engine_sidecar.gateway.policy.source import FilePolicySource

    idle = {**BENCH_TENANT, "guaranteed_blocks": 16, "max_blocks_per_engine": 1024}
    bench = BENCH_TENANT
    chat = chat_body(args.tokenizer, args.chat_tokens)
    if args.near_limit:  # the exact count fits (one block to spare), the ceiling does not
        from transformers import AutoTokenizer

        exact = len(render_chat(AutoTokenizer.from_pretrained(args.tokenizer),
                                chat["messages"], True)) + 8
        needs = -(-(exact + chat["max_tokens"]) // 32) + 1
        bench = {**BENCH_TENANT, "guaranteed_blocks": needs, "max_blocks_per_engine": needs}
    tenants = {"bench": bench, **{f"idle-{i}": idle for i in range(args.tenants - 1)}}
    policy_file, secrets_dir, tokens = write_policy(workdir, "stub", tenants)
    gateway = Gateway(GatewayConfig(upstream=upstream, secrets_dir=secrets_dir),
                      FilePolicySource(policy_file))
    assert gateway.policy_source is not None
    gateway.policy_source.poll(gateway.holder)  # type: ignore[attr-defined]
    await gateway.monitor.probe(gateway.upstream.client)
    gateway.token_counter = counter = gateway.load_tokenizer(args.tokenizer)
    active = gateway.intake.active()
    headers = [(b"authorization", f"Bearer {tokens['bench']}".encode()),
               (b"content-type", b"application/json")]
    template = json.dumps(chat).encode()
    count = args.requests
    warm = 50
    bodies = [template.replace(UNIQUE, str(i).encode()) for i in range(count + warm)]
    offset = warm

    released: list[float] = []
    off_path: list[float] = []  # the exact count taken after a ceiling admission

    async def decision(i: int) -> None:
        active = gateway.intake.active()
        tenant_id = gateway.intake.authenticate(active, headers)
        admitted = await gateway.admitter.admit(Kind.CHAT, bodies[offset + i], headers,
                                                _never, active, tenant_id)
        assert admitted is not None
        start = time.thread_time()
        admitted.reservation.release("completed")  # when the engine is done: not the decision
        released.append(time.thread_time() - start)

    offset = 0
    await _cpu(decision, warm)
    offset = warm
    if args.profile:
        profiler = cProfile.Profile(time.thread_time)
        profiler.enable()
        await _cpu(decision, count)
        profiler.disable()
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(45)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
        return
    await asyncio.gather(*gateway.admitter.ceiling.recounts)
    released.clear()
    on_ceiling = gateway.admitter.ceiling.admissions
    # Back to back, as a busy sidecar decides: the counts taken after admission wait
    # (`ceiling.RECOUNT_AFTER_S`) and run after the last decision, measured apart.
    total = [whole - release for whole, release in zip(await _cpu(decision, count),
                                                       released, strict=True)]
    on_ceiling = gateway.admitter.ceiling.admissions - on_ceiling
    start = time.thread_time()
    await asyncio.gather(*gateway.admitter.ceiling.recounts)
    off_path.append((time.thread_time() - start) / count)
    gateway.prompts.cache.clear()

    parsed = [parse(Kind.CHAT, body) for body in bodies[warm:]]

    async def auth(_i: int) -> None:
        gateway.intake.authenticate(active, headers)

    async def parse_step(i: int) -> None:
        parse(Kind.CHAT, bodies[warm + i])

    counted: list[Any] = []

    async def count_step(i: int) -> None:
        counted.append(await gateway.prompts.count(counter, parsed[i], gateway.monitor.model))

    async def fingerprints(i: int) -> None:
        prompt_fingerprints(counted[i], active.policy.block_size)

    rows = [("whole decision", total), ("count after admission", off_path),
            ("  authenticate", await _cpu(auth, count)),
            ("  parse and vet the body", await _cpu(parse_step, count)),
            ("  count: cache key + /tokenize", await _cpu(count_step, count)),
            ("  block fingerprints", await _cpu(fingerprints, count))]
    shapes = [RequestShape((len(ids),), parsed[i].requested_max_tokens, parsed[i].n,
                           parsed[i].prompt_param, parsed[i].max_tokens_param, None,
                           prompt_fingerprints((ids,), active.policy.block_size))
              for i, (ids,) in enumerate(counted)]
    tickets: list[Any] = []

    async def queue_step(i: int) -> None:
        ticket = gateway.queue.submit("bench", shapes[i])
        assert ticket.reservation is not None
        tickets.append(ticket)

    if not args.near_limit:  # near the limit, a second reservation would not fit
        rows.append(("  queue decision + reservation", await _cpu(queue_step, count)))
    for ticket in tickets:
        ticket.reservation.release("completed")
    rows.append(("release, once the engine is done", released))
    ids = len(counted[0][0])
    print(f"\nadmission decision CPU, chat of {ids} tokens ({len(bodies[warm])} bytes), "
          f"{count} unique requests, one at a time, {args.tenants} tenant(s) in the policy "
          "(us, thread CPU time)")
    print(f"admitted on the prompt's ceiling, counted after admission: {on_ceiling} of "
          f"{count}" + (" (--near-limit: maxBlocks fits the count only)"
                        if args.near_limit else ""))
    for name, samples in rows:
        print(f"{name:<32} {_us(samples)}")
    print("the stages below are the path that counts first (a ceiling admission skips the "
          "count and the fingerprints); the rest of the whole decision: the rewritten "
          "body, metrics, awaits; 'count after admission' is the loop's CPU for the exact "
          "count once admitted, not on the request's path")
    gateway.upstream.pool.close()
    await gateway.upstream.client.aclose()


def _run(args: argparse.Namespace) -> int:
    if args.tenants < 1:
        raise SystemExit("--tenants: at least 1 (the bench's own tenant)")
    setup = Setup(Path(tempfile.mkdtemp(prefix="kvquota-bench-admission-")))
    args.stub_tokenizer = args.tokenizer
    args.others_cpu = None
    if args.pin:
        this_cpu, args.others_cpu = args.pin.split(",")
        os.sched_setaffinity(0, {int(this_cpu)})
    try:
        upstream = start_stub(setup, args)
        home = setup.workdir / "sidecar"
        home.mkdir()
        server.run(_measure(args, upstream, home), args.event_loop)
    finally:
        setup.close()
    return 0
