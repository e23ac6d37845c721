"""Kubernetes-convention conditions (metav1.Condition) for our status subresources.

Why a helper: `lastTransitionTime` must move only when a condition flips, every
condition carries `observedGeneration`, and all of a kind's condition types exist
from the first visit (as Unknown if need be), so `kubectl wait` and dashboards never
see a half-populated list. One pure function keeps the operator and local mode equal.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from kvquota.api import ConditionReason, ConditionType

ConditionStatus = Literal["True", "False", "Unknown"]


@dataclass(frozen=True)
class Want:
    """A desired condition, before the bookkeeping fields are filled in."""

    type: ConditionType
    status: ConditionStatus
    # A ConditionReason, or the reason of a condition kept as the status holds it.
    reason: ConditionReason | str
    message: str = ""


def timestamp(now: datetime) -> str:
    """metav1.Time: RFC 3339, seconds precision, UTC."""
    return now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def merge_conditions(
    old: Sequence[Mapping[str, Any]] | None,
    wanted: Sequence[Want],
    *,
    generation: int | None,
    now: datetime,
) -> list[dict[str, Any]]:
    """The full condition list: `wanted` in order, then conditions of types we do not own.

    `lastTransitionTime` is carried over unless the status flipped, so a re-render
    that changes only a message does not look like a transition.
    """
    previous = {str(c.get("type")): c for c in old or () if isinstance(c, Mapping)}
    result: list[dict[str, Any]] = []
    for want in wanted:
        before = previous.get(want.type)
        flipped = before is None or before.get("status") != want.status
        condition: dict[str, Any] = {  # plain strings, as the status holds them
            "type": str(want.type),
            "status": want.status,
            "lastTransitionTime": (
                timestamp(now) if flipped or before is None
                else before.get("lastTransitionTime") or timestamp(now)
            ),
            "reason": str(want.reason),
            "message": want.message,
        }
        if generation is not None:
            condition["observedGeneration"] = generation
        result.append(condition)
    owned = {want.type for want in wanted}
    result.extend(dict(c) for t, c in previous.items() if t not in owned)
    return result


def find(conditions: Sequence[Mapping[str, Any]] | None, type_: str) -> Mapping[str, Any] | None:
    for condition in conditions or ():
        if condition.get("type") == type_:
            return condition
    return None
