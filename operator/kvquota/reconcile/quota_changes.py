"""Which TenantQuota events change a policy, and which pools they change.

kopf's event handler sees every event of a quota, our own status writes included;
re-planning a pool of 1,000 quotas for each would double the work of every edit.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any


def pool_name(spec: Mapping[str, Any] | None) -> str | None:
    """The quota's `spec.poolRef.name` (None when unset)."""
    ref = (spec or {}).get("poolRef") or {}
    name = ref.get("name") if isinstance(ref, Mapping) else None
    return str(name) if name else None


class QuotaChanges:
    """The spec of every quota as last reconciled, to tell which events change a policy
    and which pools they change (both, when `poolRef` moved)."""

    def __init__(self) -> None:
        self._specs: dict[tuple[str, str], dict[str, Any]] = {}

    def pools(self, namespace: str, name: str, spec: Mapping[str, Any] | None,
              *, deleted: bool) -> list[str]:
        key = (namespace, name)
        before = self._specs.pop(key, None) if deleted else self._specs.get(key)
        now = dict(spec or {})
        if not deleted:
            if before == now:
                return []  # a status or metadata write, ours or anyone's
            self._specs[key] = copy.deepcopy(now)
        pools = {pool_name(now), pool_name(before)} - {None}
        return sorted(p for p in pools if p)

    def forget(self, namespace: str, name: str) -> None:
        """After a failed reconcile: the next event of the quota tries again."""
        self._specs.pop((namespace, name), None)
