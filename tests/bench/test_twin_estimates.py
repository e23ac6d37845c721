"""The twin learns answer lengths the way the sidecar does: each finished turn's
output goes through the admission queue's `OutputEstimates`, so a twin run reserves
what the product would."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine_sidecar.contract.names import RESERVED_BLOCKS_ARG
from engine_sidecar.contract.policy import EnginePolicy, TenantPolicy, Tier
from engine_sidecar.gateway.admission.output_estimate import MIN_SAMPLES
from kvquota_lab.bench.admission import TWIN_ROUTE, TwinGateway


@dataclass
class _Outcome:
    output_tokens: int = 0


@dataclass
class _Turn:  # what the twin passes as a ticket's payload: its outcome is filled in
    outcome: _Outcome = field(default_factory=_Outcome)


def _gateway() -> TwinGateway:
    acme = TenantPolicy(tenant_id="acme", tier=Tier.PREMIUM, priority=0, guaranteed_blocks=0,
                        max_blocks_per_engine=1000, max_tokens=4096, default_max_tokens=1024)
    policy = EnginePolicy(pool="default/p", model="m", block_size=16,
                          tenants={"acme": acme}).with_version()
    return TwinGateway(policy, clock=lambda: 0.0, stats=lambda: None, stats_interval=0.1,
                       max_model_len=None, seed=1)


def test_finished_twin_turns_teach_the_estimate_that_later_turns_reserve() -> None:
    gateway = _gateway()
    for _ in range(MIN_SAMPLES):
        turn = _Turn()
        ticket = gateway.submit("acme", list(range(64)), 4096, None, turn)
        assert ticket.reservation is not None and ticket.verdict is not None
        assert ticket.verdict.output_tokens == 1024  # the tier default, nothing learned
        turn.outcome.output_tokens = 200  # the twin records the turn, then releases
        ticket.reservation.release("completed")
    assert gateway.queue.estimates.learned("acme", TWIN_ROUTE) == 200
    later = gateway.submit("acme", list(range(64)), 4096, None, _Turn())
    assert later.verdict is not None and later.verdict.output_tokens == 200
    assert gateway.ledger.reserved_blocks("acme") == (64 + 200) // 16 + 1
    # What the plugin is told the turn reserved: 64 + 200 tokens, 17 blocks of 16.
    assert gateway.plugin_args(later) == {RESERVED_BLOCKS_ARG: 17}


def test_a_turn_that_did_not_complete_teaches_nothing() -> None:
    gateway = _gateway()
    for _ in range(MIN_SAMPLES):
        turn = _Turn(_Outcome(output_tokens=3))
        ticket = gateway.submit("acme", list(range(64)), 4096, None, turn)
        assert ticket.reservation is not None
        ticket.reservation.release("cancelled")
    assert gateway.queue.estimates.learned("acme", TWIN_ROUTE) is None
