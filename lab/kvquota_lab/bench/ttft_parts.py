"""Where a turn's time to first token went, and what the protected tier's tail pays for
sharing the engine (#50).

The twin attributes every turn's TTFT, exactly, to parts. Before the engine:

- `sidecar`: from the client's first attempt until the sidecar forwarded the admitted
  one (refused attempts and the client's waits before retrying, and the admitted
  attempt's time in the sidecar's admission queue);
- `engine_queue`: from then until the engine first scheduled it (its waiting queue,
  and the rest of the step that was running when it came). `queue_by` says why each
  step it waited through left it waiting: `tokenBudget` (the step's
  max_num_batched_tokens went to requests ahead of it, running ones first),
  `seats` (max_num_seqs running), `blocks` (anything else: no free KV blocks for it,
  or a request ahead of it in the queue that had none), `inProgress` (the step that
  was running when it came).

From then until its first token, each step's seconds by what the step computed (the
cost profile is linear, so a step's time is a sum over what it scheduled):

- `own`: the turn's prompt tokens (and the attention they read), computed once;
- `recompute`: its prompt tokens computed again after a preemption;
- `preempted`: whole steps it spent back in the waiting queue after a preemption;
- `other_tiers`: other tiers' prompt tokens in the same steps (batch interference);
- `same_tier`: the prompt tokens of its own tier's other requests in those steps;
- `batch`: the rest: step overhead, every decoding sequence, idle time.

A turn of the tail (TTFT above the no-noise baseline's p99) is compared with the same
turn (session, turn) in the baseline run, the tier alone on the engine: what it took
more than that turn alone is, exactly, the sum of its parts' differences, grouped as
the issue asks:

- `sidecar`, `engineQueue`: the differences of those parts;
- `interference`: of `other_tiers`;
- `preemption`: of `recompute` and `preempted`;
- `prefixMiss`: of `own`: prompt tokens computed that the turn found cached alone (a
  lease or a prefix-cache entry lost to the other tiers);
- `other`: of `same_tier` and `batch` (larger batches of decodes, more steps).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvquota_lab.bench.cost import CostProfile
    from kvquota_lab.bench.metrics import Outcome
    from kvquota_lab.twin.harness import StepRecord

CAUSES = ("sidecar", "engineQueue", "interference", "preemption", "prefixMiss", "other")
QUEUE_REASONS = ("tokenBudget", "seats", "blocks", "inProgress")
_SUMMED = ("sidecar", "engine_queue", "own", "recompute", "preempted", "other_tiers",
           "same_tier", "batch")


@dataclass(slots=True)
class TtftParts:
    """One turn's TTFT in seconds by where it went (the module docstring); they sum
    to the TTFT."""

    sidecar: float = 0.0
    engine_queue: float = 0.0
    own: float = 0.0
    recompute: float = 0.0
    preempted: float = 0.0
    other_tiers: float = 0.0
    same_tier: float = 0.0
    batch: float = 0.0
    # `engine_queue` again, by why the engine left it waiting (QUEUE_REASONS).
    queue_by: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(getattr(self, name) for name in _SUMMED)

    def causes(self) -> dict[str, float]:
        """The parts grouped as the tail split reports them."""
        return {
            "sidecar": self.sidecar,
            "engineQueue": self.engine_queue,
            "interference": self.other_tiers,
            "preemption": self.recompute + self.preempted,
            "prefixMiss": self.own,
            "other": self.same_tier + self.batch,
        }


@dataclass(slots=True)
class _Pending:
    """A turn in the engine that has not sampled its first token."""

    tier: str
    forwarded: float  # when the sidecar forwarded it
    parts: TtftParts
    admitted: float | None = None
    reached: int = 0  # most tokens it has had computed; below that is recompute
    preempted: bool = False


@dataclass
class TtftLedger:
    """Attributes each engine step's seconds to the turns waiting for a first token.

    The twin calls `entered` when the engine receives a turn, `step` after every step
    and `take` once the turn is done."""

    profile: CostProfile
    max_num_batched_tokens: int
    max_num_seqs: int
    _pending: dict[str, _Pending] = field(default_factory=dict)
    _done: dict[str, TtftParts] = field(default_factory=dict)

    def entered(self, req_id: str, tier: str, arrival: float, sidecar: float) -> None:
        """`arrival`: the turn's first attempt; `sidecar`: the seconds since then
        before the sidecar forwarded the attempt the engine now has."""
        self._pending[req_id] = _Pending(tier, arrival + sidecar, TtftParts(sidecar=sidecar))

    def take(self, req_id: str) -> TtftParts | None:
        """The turn's parts once it has its first token (None: it never had one)."""
        self._pending.pop(req_id, None)
        return self._done.pop(req_id, None)

    def _why_waiting(self, record: StepRecord) -> str:
        """Why a request in the waiting queue was left there by this step."""
        if sum(record.num_scheduled_tokens.values()) >= self.max_num_batched_tokens:
            return "tokenBudget"
        if len(record.num_scheduled_tokens) >= self.max_num_seqs:
            return "seats"
        return "blocks"

    def step(self, record: StepRecord, tier_of: Mapping[str, str]) -> None:
        """`tier_of`: the tier of every request the step may have scheduled."""
        admitted = set(record.admitted_req_ids)
        full = (self._why_waiting(record), record.duration)
        for req_id, turn in self._pending.items():
            if turn.admitted is not None:
                continue
            queue_by = turn.parts.queue_by
            if not queue_by:  # its first step: it came while the last one ran
                queue_by["inProgress"] = record.start_time - turn.forwarded
            if req_id in admitted:
                turn.admitted = record.start_time
                turn.parts.engine_queue = record.start_time - turn.forwarded
                # Time the engine sat idle while it waited: nothing could be scheduled.
                idle = turn.parts.engine_queue - sum(queue_by.values())
                queue_by["blocks"] = queue_by.get("blocks", 0.0) + idle
            else:
                queue_by[full[0]] = queue_by.get(full[0], 0.0) + full[1]
        ppt = self.profile.prefill_per_token
        apt = self.profile.attention_per_context_token
        prefill: dict[str | None, float] = {}  # seconds of prompt tokens, by tier
        for req_id, num_tokens in record.num_scheduled_tokens.items():
            if req_id not in record.decode_req_ids:
                tier = tier_of.get(req_id)
                prefill[tier] = prefill.get(tier, 0.0) + (
                    ppt * num_tokens + apt * record.context_by_req.get(req_id, 0))
        all_prefill = sum(prefill.values())
        preempted = set(record.preempted_req_ids)
        for req_id, turn in self._pending.items():
            if turn.admitted is None:
                continue
            parts = turn.parts
            tokens = record.num_scheduled_tokens.get(req_id)
            if tokens is None and (turn.preempted or req_id in preempted):
                turn.preempted = True
                parts.preempted += record.duration
                continue
            mine = 0.0
            if tokens is not None:
                turn.preempted = False
                context = record.context_by_req.get(req_id, 0)
                mine = ppt * tokens + apt * context
                again = max(0, min(context, turn.reached) - (context - tokens))
                turn.reached = max(turn.reached, context)
                parts.recompute += mine * again / tokens
                parts.own += mine * (tokens - again) / tokens
            same = prefill.get(turn.tier, 0.0) - mine
            others = all_prefill - prefill.get(turn.tier, 0.0)
            parts.same_tier += same
            parts.other_tiers += others
            parts.batch += record.duration - mine - same - others
        end = record.start_time + record.duration
        for req_id in record.first_token_req_ids:
            done = self._pending.pop(req_id, None)
            if done is None or done.admitted is None:
                continue
            parts = done.parts
            # Time between steps (the engine idle with the turn admitted) is batch time.
            accounted = (parts.own + parts.recompute + parts.preempted + parts.other_tiers
                         + parts.same_tier + parts.batch)
            parts.batch += (end - done.admitted) - accounted
            self._done[req_id] = parts


def tail_split(
    outcomes: Iterable[Outcome], alone: Iterable[Outcome], tier: str, threshold: float
) -> dict[str, Any] | None:
    """The protected tier's turns above `threshold` (the baseline's p99), each against
    the same turn in the baseline run (`alone`): seconds over it by cause (summed over
    the tail turns). None when a tail turn has no parts (a backend that cannot see
    the engine's steps)."""
    reference = {(o.session, o.turn): o.ttft_parts for o in alone
                 if o.tier == tier and o.status == "ok" and o.ttft_parts is not None}
    tail = [o for o in outcomes
            if o.tier == tier and o.status == "ok" and (o.ttft or 0.0) > threshold]
    if any(o.ttft_parts is None for o in tail):
        return None
    seconds = dict.fromkeys(CAUSES, 0.0)
    queue_by = dict.fromkeys(QUEUE_REASONS, 0.0)
    unmatched = 0
    for outcome in tail:
        assert outcome.ttft_parts is not None
        ref = reference.get((outcome.session, outcome.turn))
        if ref is None:
            unmatched += 1
            ref = TtftParts()
        mine, theirs = outcome.ttft_parts.causes(), ref.causes()
        for cause in CAUSES:
            seconds[cause] += mine[cause] - theirs[cause]
        for reason in QUEUE_REASONS:
            queue_by[reason] += (outcome.ttft_parts.queue_by.get(reason, 0.0)
                                 - ref.queue_by.get(reason, 0.0))
    over_alone = sum(seconds.values())
    return {
        "threshold": round(threshold, 4),
        "turns": len(tail),
        "excessSeconds": round(sum((o.ttft or 0.0) - threshold for o in tail), 3),
        "overAloneSeconds": round(over_alone, 3),
        "seconds": {cause: round(value, 3) for cause, value in seconds.items()},
        "engineQueueBy": {reason: round(value, 3) for reason, value in queue_by.items()},
        "dominant": max(CAUSES, key=lambda c: seconds[c]) if tail else None,
        "unmatched": unmatched,
    }


def describe(split: dict[str, Any]) -> str:
    """One line: 'N turns over the baseline p99 by X s (Y s over the same turns
    alone): cause s (share), ...', causes largest first."""
    if not split["turns"]:
        return "no turn above the baseline p99"
    total = split["overAloneSeconds"]
    causes = sorted(split["seconds"].items(), key=lambda kv: -kv[1])
    def why(cause: str) -> str:
        if cause != "engineQueue":
            return ""
        by = sorted((split.get("engineQueueBy") or {}).items(), key=lambda kv: -kv[1])
        return "".join(f", {reason} {value:.2f} s" for reason, value in by if value >= 0.005)

    cells = ", ".join(
        f"{cause} {value:.2f} s"
        + (f" ({value / total:.0%}{why(cause)})" if total > 0 else "")
        for cause, value in causes)
    unmatched = f"; {split['unmatched']} not in the baseline" if split["unmatched"] else ""
    return (f"{split['turns']} turns over the baseline p99 by {split['excessSeconds']:.2f} s "
            f"({total:.2f} s over the same turns alone): {cells}{unmatched}")
