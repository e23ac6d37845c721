"""kopf's settings for the operator, fixed on day one.

Applied by the startup handler (`kvquota.handlers.lifecycle`); `kvquota.run_operator`
names the peering when it is mandatory. Progress and diff-base live in annotations
under our own prefix, the finalizer is ours, watch and request timeouts are bounded,
and CRD scanning is off (discovery happens once at startup, so RBAC needs no access
to CustomResourceDefinitions).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from engine_sidecar.contract.names import GROUP

if TYPE_CHECKING:
    import kopf

    from kvquota.runtime import OperatorConfig

PEERING_NAME = "kvquota"
FINALIZER = f"{GROUP}/finalizer"


def configure_settings(settings: kopf.OperatorSettings, config: OperatorConfig) -> None:
    """kopf settings that must never change between releases (changing the storage
    later would make kopf re-handle every object as new)."""
    import kopf

    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    settings.watching.server_timeout = 270
    settings.watching.client_timeout = 300
    settings.watching.connect_timeout = config.timeouts.connect
    settings.networking.connect_timeout = config.timeouts.connect
    settings.networking.request_timeout = config.timeouts.read
    settings.scanning.disabled = True
    # kopf posts its own log lines as Events too, at INFO two per handled change ("Handler
    # 'pool_changed' succeeded", "Updating is processed"): API calls (thousands in a
    # burst) that tell a user nothing. Warnings and errors are still posted; the
    # operator's own Events (kopf.event) do not depend on this level.
    settings.posting.level = logging.WARNING
    settings.posting.reporting_component = "kvquota-operator"
    settings.posting.event_name_prefix = "kvquota-"
    settings.peering.name = PEERING_NAME
    settings.peering.lifetime = config.peering_lifetime
