"""Which engines run which tenant's current settings.

Engines report only the version (content hash) of the policy they applied. A pool is
Synced when every ready engine reports the current version. A tenant, though, is
Ready as soon as every ready engine runs *some* recent version that carries the
tenant's current settings: an edit to one tenant must not make every other tenant of
the pool flap to Ready=False (and patch a thousand statuses) while engines reload.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping

from engine_sidecar.contract.policy import EnginePolicy
from kvquota.policy.render import tenant_digest


class PolicyHistory:
    """The tenant digests of the last `size` policy versions of one pool."""

    def __init__(self, size: int = 32) -> None:
        self.size = size
        self._versions: OrderedDict[str, dict[str, str]] = OrderedDict()

    def record(self, policy: EnginePolicy, digests: Mapping[str, str] | None = None) -> None:
        """Remember `policy`; `digests` (tenant id -> digest) saves recomputing them."""
        if not policy.version:
            return
        self._versions[policy.version] = dict(digests) if digests is not None else {
            tenant_id: tenant_digest(tenant) for tenant_id, tenant in policy.tenants.items()
        }
        self._versions.move_to_end(policy.version)
        while len(self._versions) > self.size:
            self._versions.popitem(last=False)

    def carries_version(self, version: str) -> bool:
        return version in self._versions

    def carries(self, version: str | None, tenant_id: str, digest: str) -> bool:
        if version is None:
            return False
        return self._versions.get(version, {}).get(tenant_id) == digest

    def applied_on(
        self, versions: Iterable[str | None], tenant_id: str, digest: str
    ) -> int:
        """How many of the engines (given by their reported versions) run the tenant's
        current settings."""
        return sum(self.carries(v, tenant_id, digest) for v in versions)
