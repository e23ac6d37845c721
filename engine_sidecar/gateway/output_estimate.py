"""How many output tokens an admitted request reserves: learned per tenant and route.

Clients leave `max_tokens` generous (or unset, so the tier's default applies) while
real answers are a few hundred tokens; reserving `max_tokens` held KV nobody used and
queued premium behind its own idle reservations (issue #29). A tier whose
`reservation` is `Estimated` reserves instead the output its tenant's requests on the
same route usually produce, learned from the completions the sidecar relays
(`observe`, fed by `output_meter` at the end of each response; the twin feeds its
finished requests into the same call).

The estimator: the 90th percentile (nearest rank) of the latest `WINDOW` output
lengths of the tenant on that route, capped by the request's `max_tokens`.
- A high quantile, not the mean: underestimating costs a request that outgrows its
  reservation its headroom and, when memory is short, a preemption (recompute), while
  overestimating costs only KV reserved for a while; at the 90th percentile about one
  request in ten decodes past its estimate, and it is then charged the blocks it
  really holds (admission's `charged`), so the accounting stays right either way.
- Not the maximum: one long answer would pin every later request at `max_tokens`
  again, which is the waste this replaces.
- A window of the latest 64, not all history: it follows a tenant whose workload
  changes (a new prompt template, another client) within a few dozen requests, and
  64 samples make the 90th percentile an order statistic with six samples above it,
  stable enough that one outlier moves it by one rank.
- Per route (completions, chat, responses) when the route has `MIN_SAMPLES` of its
  own, because one tenant's chat turns and batch completions differ by an order of
  magnitude; else the tenant's samples over all routes; else the tier's default
  (`defaultMaxTokens`, what the operator declared a normal answer to be) until
  `MIN_SAMPLES` requests have finished.

Output lengths are per sequence: a response with `n` choices counts its total over
`n`. Memory is bounded: `WINDOW` integers per tenant and route, for the tenants the
policy names (`retain`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Container
from dataclasses import dataclass, field

from engine_sidecar.contract.policy import EnginePolicy, ReservationMode, TenantPolicy

WINDOW = 64  # latest output lengths kept per tenant and route
MIN_SAMPLES = 8  # below this the window says too little; the tier default applies
QUANTILE = 0.9
ALL_ROUTES = ""  # the key of a tenant's samples over every route


@dataclass
class _Window:
    """The latest output lengths of one tenant on one route, and their quantile."""

    lengths: deque[int] = field(default_factory=lambda: deque(maxlen=WINDOW))
    quantile: int | None = None  # None until MIN_SAMPLES

    def add(self, tokens: int) -> None:
        self.lengths.append(tokens)
        if len(self.lengths) >= MIN_SAMPLES:
            ordered = sorted(self.lengths)
            rank = max(1, -(-len(ordered) * QUANTILE // 1))  # nearest rank: ceil(q * n)
            self.quantile = ordered[int(rank) - 1]


class OutputEstimates:
    """Per tenant and route: the output tokens an `Estimated` reservation counts."""

    def __init__(self) -> None:
        self._windows: dict[tuple[str, str], _Window] = {}

    def observe(self, tenant_id: str, route: str, output_tokens: int, n: int = 1) -> None:
        """A response of `tenant_id` on `route` finished with `output_tokens` in all."""
        if output_tokens < 0 or n < 1:
            raise ValueError(f"output_tokens must be >= 0 and n >= 1, got {output_tokens}, {n}")
        per_sequence = -(-output_tokens // n)
        for key in dict.fromkeys(((tenant_id, route), (tenant_id, ALL_ROUTES))):
            window = self._windows.get(key)
            if window is None:
                window = self._windows[key] = _Window()
            window.add(per_sequence)

    def learned(self, tenant_id: str, route: str) -> int | None:
        """The learned estimate (None: fewer than MIN_SAMPLES finished)."""
        for key in ((tenant_id, route), (tenant_id, ALL_ROUTES)):
            window = self._windows.get(key)
            if window is not None and window.quantile is not None:
                return window.quantile
        return None

    def samples(self, tenant_id: str) -> int:
        window = self._windows.get((tenant_id, ALL_ROUTES))
        return len(window.lengths) if window else 0

    def output_tokens(self, tenant: TenantPolicy, route: str, policy: EnginePolicy) -> int | None:
        """What a request of `tenant` on `route` reserves for its output, before the cap
        of its own max_tokens; None: its tier reserves `Full` (max_tokens)."""
        if policy.reservation_for(tenant.tier) is ReservationMode.FULL:
            return None
        learned = self.learned(tenant.tenant_id, route)
        return tenant.default_max_tokens if learned is None else learned

    def in_use(self, tenant: TenantPolicy, policy: EnginePolicy, route: str = ALL_ROUTES) -> int:
        """The output tokens a request of `tenant` on `route` reserves now, before its
        own max_tokens caps it (a `Full` tier: the tenant's maxTokens ceiling)."""
        tokens = self.output_tokens(tenant, route, policy)
        return tenant.max_tokens if tokens is None else tokens

    def routes(self, tenant_id: str) -> list[str]:
        """The routes the tenant has finished requests on (`ALL_ROUTES` excluded)."""
        return sorted(r for t, r in self._windows if t == tenant_id and r != ALL_ROUTES)

    def retain(self, tenants: Container[str]) -> None:
        """Forget tenants the policy no longer names."""
        for key in [k for k in self._windows if k[0] not in tenants]:
            del self._windows[key]
