"""Reservations that follow real use: a request reserves its prompt plus the output
its tenant's requests usually produce, not max_tokens; `Full` keeps max_tokens; a
tenant whose requests decoded past their estimates is charged what they hold."""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import pytest
from prometheus_client import generate_latest

from engine_sidecar.contract.names import RESERVED_BLOCKS_ARG
from engine_sidecar.contract.policy import ReservationMode, Tier
from engine_sidecar.contract.stats import EngineStats, SidecarStatus, TenantEngineStats
from engine_sidecar.gateway.admission.ledger import Ledger
from engine_sidecar.gateway.admission.output_estimate import MIN_SAMPLES, OutputEstimates
from engine_sidecar.gateway.admission.queue import AdmissionQueue, Ticket
from engine_sidecar.gateway.admission.rules import Decision, RequestShape
from engine_sidecar.gateway.policy.active import build as build_active
from engine_sidecar.gateway.relay.output_meter import OutputMeter
from engine_sidecar.gateway.telemetry.metrics import GatewayMetrics, StateSources
from engine_sidecar.gateway.telemetry.status import DecisionCounters, build_status

from .conftest import StubFactory
from .helpers import WAIT, Keys, http_get, http_post, make_policy, tenant, wait_for
from .stub_engine import StubEngine

BLOCK = 32
PROMPT = 100  # tokens: 4 blocks
GENEROUS = 4096  # max_tokens as clients send it: ceil((100 + 4096) / 32) = 132 blocks


def _queue(
    mode: ReservationMode | None = None,
    stats: Callable[[], EngineStats | None] = lambda: None, **limits: object,
) -> AdmissionQueue:
    acme = tenant("acme", tier="premium", priority=0, max_tokens=GENEROUS,
                  default_max_tokens=1024, max_blocks_per_engine=300,
                  prefix_cache_isolation="Shared", max_queue_seconds=30,
                  max_queued_requests=100, **limits)
    reservation = {Tier.PREMIUM: mode} if mode is not None else {}
    queue = AdmissionQueue(Ledger(), clock=lambda: 0.0, rng=random.Random(1),
                           stats=stats, max_model_len=lambda: None)
    queue.set_policy(make_policy(acme, reservation=reservation, auth={}))
    return queue


def _answers(queue: AdmissionQueue, route: str = "chat", count: int = 20) -> None:
    """`count` finished answers of 10, 20, ... tokens (of 20: the 90th percentile is 180)."""
    for i in range(count):
        queue.estimates.observe("acme", route, 10 * (i + 1))


def _ask(
    queue: AdmissionQueue, route: str = "chat", max_tokens: int | None = GENEROUS
) -> Ticket:
    return queue.submit("acme", RequestShape((PROMPT,), max_tokens, route=route))


def test_generous_max_tokens_no_longer_queue_once_answer_lengths_are_learned() -> None:
    estimated, full = _queue(), _queue(ReservationMode.FULL)
    _answers(estimated), _answers(full)
    admitted = [_ask(estimated) for _ in range(20)]
    # Their prompts take 4 blocks each; their answers (10-200 tokens, 28 of them fit in
    # each prompt's last block) are charged one bound for the 20 together, the peak of
    # what they will hold beyond this as some grow and others finish (giving back their
    # 4 unshared prompt blocks): 24 blocks, where their 90th percentiles (180 tokens)
    # would charge 20 * 152 / 32 = 95.
    assert all(t.admitted for t in admitted)
    assert estimated.ledger.reserved_blocks("acme") == 20 * 4 + 24
    verdict = admitted[0].verdict
    assert verdict is not None and verdict.output_tokens == 180  # alone: its p90
    assert verdict.max_tokens == GENEROUS  # the engine still may decode to max_tokens
    # Full reserves max_tokens: 132 blocks each, the third waits on maxBlocks.
    first, second, third = _ask(full), _ask(full), _ask(full)
    assert first.admitted and second.admitted and not third.settled
    assert third.verdict is not None and third.verdict.decision is Decision.REJECTED_QUOTA


def test_the_tier_default_is_reserved_until_enough_answers_finished() -> None:
    queue = _queue()
    _answers(queue, count=MIN_SAMPLES - 1)
    early = _ask(queue)
    assert early.verdict is not None and early.verdict.output_tokens == 1024
    queue.estimates.observe("acme", "chat", 200)
    later = _ask(queue)
    assert later.verdict is not None and later.verdict.output_tokens < 1024


def test_a_small_max_tokens_caps_the_estimate() -> None:
    queue = _queue()
    _answers(queue)
    capped = _ask(queue, max_tokens=50)
    assert capped.verdict is not None and capped.verdict.output_tokens == 50


def test_each_route_learns_its_own_answers_and_borrows_the_tenants_until_it_has_some() -> None:
    queue = _queue()
    _answers(queue, "chat")  # chat turns: 10-200 tokens
    for _ in range(3):
        queue.estimates.observe("acme", "completion", 2000)
    # Three completions are too few of their own: the tenant's answers over all routes.
    policy = queue.policy
    assert policy is not None
    acme = policy.tenants["acme"]

    def p90(route: str) -> float:
        outlook = queue.estimates.outlook(acme, route, policy)
        assert outlook is not None
        return outlook.quantile

    assert p90("completion") == 2000
    for _ in range(MIN_SAMPLES):
        queue.estimates.observe("acme", "completion", 1800)
    assert (p90("completion"), p90("chat")) == (2000, 180)


def test_a_response_of_n_choices_counts_per_choice() -> None:
    estimates = OutputEstimates()
    for _ in range(MIN_SAMPLES):
        estimates.observe("acme", "completion", 800, n=4)
    assert estimates.learned("acme", "completion") == 200


def test_a_negative_output_count_is_refused_with_what_was_wrong() -> None:
    with pytest.raises(ValueError, match="output_tokens must be >= 0 and n >= 1, got -1, 1"):
        OutputEstimates().observe("acme", "chat", -1)


def test_requests_that_decoded_past_their_estimates_are_charged_what_they_hold() -> None:
    seen: list[EngineStats] = [_engine(running_blocks=0)]
    # A hard ceiling: with aboveMax Reclaimable it would run into the idle engine.
    queue = _queue(stats=lambda: seen[-1], above_max="Never")
    _answers(queue)
    first = _ask(queue)
    # Alone, its answer is charged at its 90th percentile: 4 + ceil((180 - 28) / 32).
    assert first.admitted and queue.ledger.reserved_blocks("acme") == 9
    # It decodes far past its estimate (in a response the sidecar cannot follow): the
    # plugin reports it holding 295 blocks. The tenant is charged those, so it is at
    # its maxBlocks and the next request waits.
    seen.append(_engine(running_blocks=295))
    waiting = _ask(queue)
    assert not waiting.settled and waiting.verdict is not None
    assert waiting.verdict.decision is Decision.REJECTED_QUOTA
    assert waiting.verdict.error is not None
    assert "holds or has reserved 295 of its 300" in waiting.verdict.error.message
    seen.append(_engine(running_blocks=9))  # it finished; the estimate holds again
    assert first.reservation is not None
    first.reservation.release()
    assert queue.pump() == [waiting] and waiting.admitted


def _engine(running_blocks: int) -> EngineStats:
    return EngineStats(timestamp=time.time(), total_blocks=10_000, free_blocks=9_000,
                       tenants={"acme": TenantEngineStats(running_blocks=running_blocks,
                                                          running=1)})


def test_a_full_tier_and_an_estimated_tier_side_by_side() -> None:
    premium = tenant("prem", tier="premium", priority=0, max_tokens=GENEROUS,
                     default_max_tokens=1024, max_blocks_per_engine=300,
                  prefix_cache_isolation="Shared")
    free = tenant("cheap", tier="free", priority=2, max_tokens=GENEROUS,
                  default_max_tokens=1024, max_blocks_per_engine=300,
                  prefix_cache_isolation="Shared")
    policy = make_policy(premium, free, reservation={Tier.PREMIUM: ReservationMode.FULL})
    queue = AdmissionQueue(Ledger(), clock=lambda: 0.0, max_model_len=lambda: None)
    queue.set_policy(policy)
    for tenant_id in ("prem", "cheap"):
        for _ in range(MIN_SAMPLES):
            queue.estimates.observe(tenant_id, "chat", 100)
    prem = queue.submit("prem", RequestShape((PROMPT,), GENEROUS, route="chat"))
    cheap = queue.submit("cheap", RequestShape((PROMPT,), GENEROUS, route="chat"))
    assert prem.verdict is not None and prem.verdict.output_tokens == GENEROUS
    assert cheap.verdict is not None and cheap.verdict.output_tokens == 100


# -- the relayed responses: what the sidecar learns from ------------------------------


def test_the_meter_reads_a_plain_answers_usage() -> None:
    meter = OutputMeter("completion")
    meter.feed(b'{"choices":[{"text":"hi"}],"usage":{"prompt_tokens":9,')
    meter.feed(b'"completion_tokens":42,"total_tokens":51}}')
    assert meter.output_tokens() == 42


def test_the_meter_counts_a_chat_streams_token_events_without_usage() -> None:
    meter = OutputMeter("chat")
    meter.feed(b'data: {"choices":[{"delta":{"role":"assistant"}}]}\n\n')
    for i in range(5):
        meter.feed(b'data: {"choices":[{"delta":{"content":"t%d"}}]}\n\n' % i)
    meter.feed(b"data: [DONE]\n\n")
    assert meter.output_tokens() == 5


def test_the_meter_prefers_the_streams_usage_when_asked_for() -> None:
    meter = OutputMeter("chat")
    meter.feed(b'data: {"choices":[{"delta":{"content":"a b"}}]}\n\n')
    meter.feed(b'data: {"choices":[],"usage":{"completion_tokens":7}}\n\ndata: [DONE]\n\n')
    assert meter.output_tokens() == 7


def test_the_meter_reads_the_responses_apis_output_tokens() -> None:
    meter = OutputMeter("responses")
    for _ in range(3):
        meter.feed(b'event: response.output_text.delta\ndata: {"delta":"x"}\n\n')
    assert meter.output_tokens() == 3
    meter.feed(b'event: response.completed\ndata: {"response":{"usage":{"input_tokens":5,'
               b'"output_tokens":12,"output_tokens_details":{"reasoning_tokens":0}}}}\n\n')
    assert meter.output_tokens() == 12


def test_the_sidecar_learns_answer_lengths_from_the_responses_it_relays(
    stub_sidecar: StubFactory, keys: Keys
) -> None:
    # The stub answers max_tokens tokens and reports it in the stream's usage event.
    harness, stub = stub_sidecar(StubEngine(chunks=2))
    harness.apply(make_policy(tenant("acme", max_tokens=64, default_max_tokens=32)))
    token = keys.hs("acme")
    for _ in range(MIN_SAMPLES):
        reply = http_post(harness.url + "/v1/completions",
                          json={"prompt": "x y", "max_tokens": 5, "stream": True},
                          headers={"Authorization": f"Bearer {token}"})
        assert reply.status_code == 200
    estimates = harness.gateway.estimates
    wait_for(lambda: estimates.learned("acme", "completion") == 5, WAIT,
             "the sidecar did not learn the relayed answers' length")
    status = http_get(harness.admin_url + "/kvquota/status").json()
    assert status["tenants"]["acme"]["usage"]["outputEstimateTokens"] == 5
    metrics = http_get(harness.admin_url + "/metrics").text
    assert ('kvquota_tenant_output_estimate_tokens{route="completion",tenant_id="acme"} 5.0'
            in metrics)
    reply = http_post(harness.url + "/v1/completions",
                      json={"prompt": "x y", "max_tokens": 60},
                      headers={"Authorization": f"Bearer {token}"})
    assert reply.status_code == 200
    forwarded = stub.received[-1]
    assert forwarded["max_tokens"] == 60  # the client's max_tokens still applies
    # The plugin is told what was reserved per sequence: 2 prompt tokens + 5, one block.
    assert forwarded["vllm_xargs"][RESERVED_BLOCKS_ARG] == 1


def _status(mode: ReservationMode | None = None) -> SidecarStatus:
    """acme has one request in flight, reserved 9 blocks at its estimate; the plugin
    reports its running requests holding 25 blocks, one of 3 victims outgrown."""
    acme = tenant("acme", tier="premium", priority=0, max_tokens=GENEROUS,
                  default_max_tokens=1024, max_blocks_per_engine=300,
                  prefix_cache_isolation="Shared")
    policy = make_policy(acme, reservation={Tier.PREMIUM: mode} if mode else {}, auth={})
    stats = _engine(running_blocks=25)
    stats.tenants["acme"].outgrown_preemptions = 1
    stats.tenants["acme"].preemptions = {"borrower": 3}
    ledger = Ledger()
    queue = AdmissionQueue(ledger, clock=lambda: 0.0, stats=lambda: stats)
    queue.set_policy(policy)
    _answers(queue)
    ledger.reserve("acme", 9)
    return build_status(ready=True, active=build_active(policy, None), policy_error=None,
                        ledger=ledger, counters=DecisionCounters(), stats=stats,
                        capacity=queue.view(), queue=queue)


def test_the_status_shows_reserved_vs_held_and_the_estimate_in_use() -> None:
    acme = _status().tenants["acme"]
    assert acme.usage.reserved_blocks == 9  # at the estimate, not max_tokens (132)
    assert acme.usage.blocks == 25  # held in the engine
    assert (acme.usage.charged_blocks, acme.usage.pending_blocks) == (25, 0)
    assert acme.usage.output_estimate_tokens == 180
    assert (acme.counters.preemptions, acme.counters.outgrown_preemptions) == (3, 1)
    full = _status(ReservationMode.FULL).tenants["acme"]
    assert full.usage.output_estimate_tokens == GENEROUS


def test_the_metrics_show_reserved_vs_charged_and_the_estimates() -> None:
    stats = _engine(running_blocks=2)
    stats.tenants["acme"].outgrown_preemptions = 4
    queue = _queue(stats=lambda: stats)
    _answers(queue, "chat")
    _ask(queue)  # 9 blocks reserved, 2 of them allocated so far
    policy = queue.policy
    assert policy is not None
    active = build_active(policy, None)
    metrics = GatewayMetrics()
    metrics.attach_state(StateSources(ledger=queue.ledger, active=lambda: active,
                                      stats=lambda: stats, label=lambda t: t, queue=queue))
    text = generate_latest(metrics.registry).decode()
    assert 'kvquota_tenant_blocks_reserved{tenant_id="acme"} 9.0' in text
    assert 'kvquota_tenant_blocks_charged{tenant_id="acme"} 9.0' in text
    assert 'kvquota_tenant_blocks_pending{tenant_id="acme"} 7.0' in text
    assert 'kvquota_tenant_output_estimate_tokens{route="chat",tenant_id="acme"} 180.0' in text
    assert 'kvquota_tenant_output_estimate_tokens{route="all",tenant_id="acme"} 180.0' in text
    assert 'kvquota_tenant_outgrown_preemptions_total{tenant_id="acme"} 4.0' in text
