"""Who a request belongs to: its tenant and session, as the sidecar admitted it.

The sidecar passes tenant, session and what it reserved through vLLM's
`sampling_params.extra_args` (`vllm_xargs`); a request without a tenant the policy
knows is unclassified, the first to give blocks back and never leased.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine_sidecar.contract.names import (
    ABOVE_MAX_ARG,
    RESERVED_BLOCKS_ARG,
    RESERVED_OUTPUT_ARG,
    SESSION_ARG,
    TENANT_ARG,
)

_MAX_ID_LEN = 253


@dataclass(frozen=True, slots=True)
class Identity:
    tenant: str | None
    session: str | None
    reserved_blocks: int | None = None  # per sequence, as admitted (None: not told)
    above_max: bool = False  # admitted beyond its tenant's maxBlocks, into idle KV
    reserved_output: int | None = None  # of reserved_blocks, output tokens per sequence

    @property
    def session_key(self) -> tuple[str, str] | None:
        if self.tenant is None or self.session is None:
            return None
        return (self.tenant, self.session)


NO_IDENTITY = Identity(None, None)


def identity_from_extra_args(extra_args: Mapping[str, Any] | None) -> Identity:
    """Tenant and session as the sidecar set them through `vllm_xargs`.

    Anything that is not a non-empty string of sane length counts as absent: such a
    request is unclassified (and never leased)."""
    if not extra_args:
        return NO_IDENTITY
    tenant = _clean_id(extra_args.get(TENANT_ARG))
    session = _clean_id(extra_args.get(SESSION_ARG)) if tenant is not None else None
    if tenant is None:
        return NO_IDENTITY
    reserved = _count(extra_args.get(RESERVED_BLOCKS_ARG), 1)
    output = _count(extra_args.get(RESERVED_OUTPUT_ARG), 0) if reserved is not None else None
    return Identity(tenant, session, reserved, extra_args.get(ABOVE_MAX_ARG) is True, output)


def _count(value: object, least: int) -> int | None:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        return None
    return value


def outgrew(identity: Identity, num_blocks: int, num_prompt_tokens: int,
            block_size: int) -> bool:
    """Did a request holding `num_blocks` outgrow what the sidecar reserved for it?

    The sidecar may have reserved at its prompt's ceiling (admitted before counting):
    told the output part, the reservation is taken at the prompt the engine counted."""
    reserved = identity.reserved_blocks
    if reserved is None:
        return False
    if identity.reserved_output is not None:
        exact = -(-(num_prompt_tokens + identity.reserved_output) // block_size)
        reserved = min(reserved, exact)
    return num_blocks > reserved


def _clean_id(value: object) -> str | None:
    if isinstance(value, str) and 0 < len(value) <= _MAX_ID_LEN:
        return value
    return None
