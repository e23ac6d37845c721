"""What admission charged each tenant against what its requests held, and how often
they outgrew it (README: reservations).

A tenant is charged once for its requests together: what they take now plus a joint
bound on how far that will still grow (`engine_sidecar.gateway.admission.joint_charge`). Two
questions about that rule, per tenant, while it has requests in flight inside the load
window, read each time the plugin publishes its stats:

- `chargedVsHeld`: the mean of what it was charged (`_TenantView.charged`) over the
  mean of what its running requests held (the plugin's `runningBlocks`). 1.0 would be
  a charge that never leaves room for growth; the per-request 90th percentiles it
  replaced ran well above.
- `outgrownShare`: the share of those readings at which its running requests held
  more than the ledger charged for them one reading earlier (committed blocks plus
  the bound), plus what it admitted in between: its requests together outgrew their
  joint charge.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class ChargeReading:
    charged: int  # what admission counts against its quota now
    held: int  # what its running requests hold in the engine
    reserved: int  # the ledger's charge: committed blocks plus the joint bound
    admitted: int  # blocks admitted so far (cumulative)
    inflight: int


@dataclass
class _Tenant:
    charged: float = 0.0
    held: float = 0.0
    readings: int = 0
    outgrown: int = 0
    last: ChargeReading | None = None


@dataclass
class ChargeLog:
    window: float  # seconds: only readings inside [0, window] count
    _tenants: dict[str, _Tenant] = field(default_factory=dict)

    def read(self, now: float, readings: Mapping[str, ChargeReading]) -> None:
        for tenant_id, reading in readings.items():
            tenant = self._tenants.setdefault(tenant_id, _Tenant())
            last, tenant.last = tenant.last, reading
            if now > self.window or reading.inflight <= 0:
                continue
            tenant.readings += 1
            tenant.charged += reading.charged
            tenant.held += reading.held
            if last is not None and last.inflight > 0 and (
                reading.held > last.reserved + (reading.admitted - last.admitted)
            ):
                tenant.outgrown += 1

    def to_json(self) -> dict[str, Any]:
        """Per tenant: mean charged and held blocks while in flight, their ratio, and
        the share of readings at which its requests outgrew their charge."""
        out: dict[str, Any] = {}
        for tenant_id, t in sorted(self._tenants.items()):
            if not t.readings:
                continue
            out[tenant_id] = {
                "meanCharged": round(t.charged / t.readings, 1),
                "meanHeld": round(t.held / t.readings, 1),
                "chargedVsHeld": round(t.charged / t.held, 3) if t.held else None,
                "outgrownShare": round(t.outgrown / t.readings, 4),
                "readings": t.readings,
            }
        return out


def charge_lines(document: dict[str, Any]) -> list[str]:
    """One report line per policy that measured charges."""
    lines = []
    for key, summary in document["policies"].items():
        charges = (summary.get("extra") or {}).get("charges")
        if not charges:
            continue
        cells = [
            f"{tenant} {_ratio(c['chargedVsHeld'])} ({c['meanCharged']:.0f} / "
            f"{c['meanHeld']:.0f}, outgrown {c['outgrownShare']:.1%})"
            for tenant, c in charges.items()
        ]
        lines.append(f"{key}: charged vs held while in flight (mean blocks; share of stats "
                     "readings its requests held more than charged a reading before): "
                     + "; ".join(cells))
    return lines


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"
