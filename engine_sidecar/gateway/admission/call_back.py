"""Whether a leased session is told to bring its next turn back to this engine.

Decided when the turn is admitted, on the same view admission used, and carried with
the admitted request to the relay, which sends the session token or clears it
(`relay.affinity`). A token is a promise of room: several sessions each told there is
room for one more turn may come back together, so each promise counts.
"""

from __future__ import annotations

from engine_sidecar.gateway.admission.rules import PoolView


def calls_back(view: PoolView, tenant_id: str, session: str, turn_blocks: int,
               max_blocks: int) -> bool:
    """Whether this engine can take the session's next turn under its tenant's ceiling
    beside the turns it has already called back: the tenant's charge here
    (`_TenantView.charged`, this turn included), plus the blocks the leases of its
    other sessions between turns pin (each was told to come back, and its next turn
    is at least that large), plus about one more turn of this session (this turn's
    blocks), within its maxBlocks."""
    seen = view.tenant(tenant_id)
    promised = sum(blocks for other, blocks in seen.leases.items()
                   if other != session and other not in seen.sessions)
    return seen.charged + promised + turn_blocks <= max_blocks
