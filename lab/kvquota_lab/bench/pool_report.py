"""The pool numbers of a bench document (`kvquota bench --replicas N`), as rows.

Per run: the protected tier's TTFT p99, its ratio to the baseline run (the same
pool and router without the noisy tiers) and to one engine at the same per-engine load
(`bench.one_engine`: single-engine KVQuota runs on several seeds, pooled), refusals of
requests within their tenant's pool-wide guarantee, how far a tenant's charges over the
pool ever passed its pool-wide maxBlocks (blocks; its work admitted into idle KV beyond
maxBlocks left out), the share of admissions that needed the shared store, pool
throughput (output tokens/s), how unevenly the router spread the requests, and what the
run cost (wall seconds per simulated engine-hour). Below the table, per run, whether the
protected tier's tenants sat at their own pool-wide maxBlocks (`pool_ceilings`): what
tells a quota that binds (stock priority has none) from admission holding a tenant
back while it had room.
"""

from __future__ import annotations

from typing import Any


def pool_rows(document: dict[str, Any]) -> list[dict[str, Any]]:
    tier = document["comparison"].get("tier")
    ratios = document["comparison"].get("ttftP99VsBaseline", {})
    one_engine = document["comparison"].get("ttftP99VsOneEngine", {})
    wall = document["run"]["wallSeconds"]
    cpu = document["run"].get("cpuSeconds", {})
    rows = []
    for key, summary in document["policies"].items():
        pool = summary["extra"].get("pool", {})
        tiers = summary["tiers"]
        per_engine = pool.get("requestsPerEngine") or [0]
        rows.append({
            "run": key,
            "router": pool.get("router"),
            "replicas": pool.get("replicas"),
            "ttftP99": tiers.get(tier, {}).get("ttftP99") if tier else None,
            "ttftP99VsBaseline": ratios.get(key),
            "ttftP99VsOneEngine": one_engine.get(key),
            "ownMaxBlocks": {t: c for t, c in pool.get("ownMaxBlocks", {}).items()
                             if c["tier"] == tier},
            "besideIdleKvSeconds": tiers.get(tier, {}).get("besideIdleKvSeconds")
            if tier else None,
            "refusedWithinPoolGuarantee": sum(
                pool.get("refusedWithinPoolGuarantee", {}).values()),
            "aboveMaxBlocks": max(pool.get("aboveMaxBlocks", {}).values(), default=None),
            "storeShare": pool.get("ledger", {}).get("storeShare"),
            "refusedWithinEngineGuarantee": sum(
                t["refusedWithinGuarantee"] for t in tiers.values()),
            "throughput": summary["throughput"],
            "requestsPerEngine": (min(per_engine), max(per_engine)),
            "wallSeconds": wall.get(key),
            "engineHours": pool.get("engineHours"),
            "wallSecondsPerEngineHour": _per(wall.get(key), pool.get("engineHours")),
            "cpuSecondsPerEngineHour": _per(cpu.get(key), pool.get("engineHours")),
        })
    return rows


def _per(seconds: float | None, engine_hours: float | None) -> float | None:
    if seconds is None or not engine_hours:
        return None
    return round(seconds / engine_hours, 1)


def _f(value: Any, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def _one_engine_note(document: dict[str, Any]) -> str:
    reference = document["comparison"].get("oneEngine")
    if not reference or not reference["seeds"]:
        return ""
    seeds = reference["seeds"]
    span = f"{seeds[0]}-{seeds[-1]}" if len(seeds) > 1 else f"{seeds[0]}"
    return (f"; 1 engine ({reference['policy']}, seeds {span}, {reference['turns']} turns "
            f"pooled) {_f(reference['ttftP99'], '{:.3f}')} s")


def format_pool_table(document: dict[str, Any]) -> str:
    tier = document["comparison"].get("tier") or "-"
    base = document["comparison"].get("baselineTtftP99")
    pool = document.get("pool", {})
    lines = [
        f"pool: {pool.get('replicas')} engines, router {pool.get('router')}; "
        f"{tier} TTFT p99 baseline {_f(base, '{:.3f}')} s" + _one_engine_note(document),
        f"{'run':<24} {'p99 s':>7} {'x base':>7} {'x 1 eng':>7} {'refused<poolG':>13} "
        f"{'refused<engG':>12} {'over poolM':>10} {'store':>6} {'tok/s':>9} {'req/engine':>11} "
        f"{'wall(cpu) s/engine-h':>21}",
    ]
    for row in pool_rows(document):
        low, high = row["requestsPerEngine"]
        lines.append(
            f"{row['run']:<24} {_f(row['ttftP99'], '{:.3f}'):>7} "
            f"{_f(row['ttftP99VsBaseline'], '{:.2f}'):>7} "
            f"{_f(row['ttftP99VsOneEngine'], '{:.2f}'):>7} "
            f"{row['refusedWithinPoolGuarantee']:>13} {row['refusedWithinEngineGuarantee']:>12} "
            f"{_f(row['aboveMaxBlocks'], '{:d}'):>10} {_f(row['storeShare'], '{:.0%}'):>6} "
            f"{_f(row['throughput'], '{:.0f}'):>9} {f'{low}-{high}':>11} "
            f"{_f(row['wallSecondsPerEngineHour'], '{:.0f}'):>12} "
            f"({_f(row['cpuSecondsPerEngineHour'], '{:.0f}')})"
        )
    window = document.get("scenario", {}).get("duration")
    for row in pool_rows(document):
        if row["ownMaxBlocks"]:
            lines.append(f"  {row['run']}: " + _own_max_line(row, tier, window))
    return "\n".join(lines)


def _own_max_line(row: dict[str, Any], tier: str, window: float | None) -> str:
    """The protected tier at its own pool-wide maxBlocks in one run: held there (and
    above it), its 429s on it and its queue time, each with how much of it had room."""
    ceilings = row["ownMaxBlocks"]
    at = ", ".join(f"{t} {c['secondsAtMaxBlocks']:.0f} s (peak {c['peakHeld']:,} of "
                   f"{c['maxBlocks']:,})" for t, c in ceilings.items())
    stock = row["besideIdleKvSeconds"] is None  # no admission: nothing refused or queued
    text = (f"{tier} at {'the' if stock else 'its own'} pool-wide maxBlocks"
            f"{' KVQuota would set' if stock else ''}: {at} of {_f(window, '{:.0f}')} s")
    above = sum(c["secondsAboveMaxBlocks"] for c in ceilings.values())
    if above:
        text += f"; above it {above:.0f} s"
    if stock:
        return text
    refused = sum(c["refusedOnMaxBlocks"] for c in ceilings.values())
    room = sum(c["refusedWithRoom"] for c in ceilings.values())
    queued = sum(c["secondsQueued"] for c in ceilings.values())
    queued_room = sum(c["secondsQueuedWithRoom"] for c in ceilings.values())
    return (text + f"; 429 on it {refused} ({room} with room); queued {queued:.0f} s "
            f"({queued_room:.0f} s with room); beside idle KV "
            f"{row['besideIdleKvSeconds']:.0f} s")
