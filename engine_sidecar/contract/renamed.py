"""Names users carry that a release renamed, and the release each old name goes away in.

Users keep these names where an upgrade does not reach them: manifests under Git,
clients, dashboards. A renamed name keeps working, with a warning naming its
replacement, for two minor releases (README: Upgrading): `RENAMED` is the one list of
them. The old module paths warn through `warn_renamed`, `kvquota inject --upgrade`
rewrites manifests by the list, and the frozen-names test accepts an old name only
while it is listed here.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass

logger = logging.getLogger("engine_sidecar")


@dataclass(frozen=True)
class Renamed:
    old: str
    new: str
    since: str  # the release that renamed it
    removed_in: str  # the first release without the old name

    def message(self) -> str:
        return (f"kvquota: {self.old} is deprecated since kvquota {self.since} and goes "
                f"away in {self.removed_in}; use {self.new} (`kvquota inject --upgrade` "
                "rewrites manifests injected by an older release)")


# 0.2.0 moved the engine side into contract/, plugin/ and gateway/.
RENAMED: tuple[Renamed, ...] = (
    Renamed("engine_sidecar.scheduler.TenantAwareScheduler",
            "engine_sidecar.plugin.scheduler.TenantAwareScheduler", "0.2.0", "0.4.0"),
    Renamed("engine_sidecar.preflight", "engine_sidecar.plugin.preflight", "0.2.0", "0.4.0"),
    Renamed("engine_sidecar.policy", "engine_sidecar.contract.policy", "0.2.0", "0.4.0"),
)
BY_OLD = {r.old: r for r in RENAMED}


def warn_renamed(old: str) -> None:
    """Say once, where an engine's log shows it, that `old` still works but is going.

    The log line is what an operator reads (vLLM's logs show warnings of any logger);
    the DeprecationWarning is for code that tests its imports."""
    renamed = BY_OLD[old]
    logger.warning(renamed.message())
    warnings.warn(renamed.message(), DeprecationWarning, stacklevel=3)
