"""One charge per tenant for its requests together (README: reservations): what they
take now plus one bound on what they will still grow, from what each has decoded."""

from __future__ import annotations

import math
import random

import pytest

from engine_sidecar.contract.policy import ReservationMode, Tier
from engine_sidecar.gateway.admission.joint_charge import (
    MIN_JOINT,
    NO_GROWTH,
    Remainder,
    Z,
    in_blocks,
)
from engine_sidecar.gateway.admission.ledger import Ledger
from engine_sidecar.gateway.admission.output_estimate import (
    HORIZON,
    WINDOW,
    Outlook,
    OutputEstimates,
)
from engine_sidecar.gateway.admission.queue import AdmissionQueue
from engine_sidecar.gateway.admission.rules import RequestShape
from engine_sidecar.gateway.relay.output_meter import OutputMeter

from .helpers import make_policy, tenant

BLOCK = 16
PROMPT = 96  # six full blocks: no free slots in the prompt's last block
ACME = tenant("acme", tier="premium", priority=0, max_tokens=4096, default_max_tokens=512,
              max_blocks_per_engine=100_000, guaranteed_blocks=100_000, max_queued_requests=1000,
              prefix_cache_isolation="Shared")
POLICY = make_policy(ACME, block_size=BLOCK)


def _estimates(lengths: list[int]) -> OutputEstimates:
    estimates = OutputEstimates()
    for length in lengths:
        estimates.observe("acme", "chat", length)
    return estimates


def test_the_remainder_is_read_beyond_what_a_request_has_decoded() -> None:
    """E[L - d | L > d], its variance and the chance of still decoding further on, over
    the window's lengths beyond d."""
    estimates = _estimates([100, 200, 300, 400, 500, 600, 700, 800, 900, 1000])
    fresh = estimates.outlook(ACME, "chat", POLICY, 0)
    assert fresh is not None
    assert fresh.mean == pytest.approx(550)  # the mean length
    assert fresh.var == pytest.approx(82_500)  # population variance of 100..1000
    assert fresh.quantile == 900  # nearest rank: 9th of 10
    assert dict(zip(HORIZON, fresh.survival, strict=True))[512] == 0.5  # 600..1000
    half = estimates.outlook(ACME, "chat", POLICY, 450)
    assert half is not None
    # Past 450 only 500..1000 remain: 750 on average, 300 to go.
    assert half.mean == pytest.approx(300)
    assert half.var == pytest.approx(29_166.67, rel=1e-4)
    assert half.quantile == 1000 - 450
    assert dict(zip(HORIZON, half.survival, strict=True))[256] == 3 / 6  # 800..1000
    # Beyond all but three lengths, the longest four stand in, measured from the length
    # just below them (600): 850 - 600 to go, whatever it has decoded past that.
    tail = estimates.outlook(ACME, "chat", POLICY, 950)
    assert tail is not None and tail.mean == pytest.approx(250)
    # Capped by what its max_tokens leaves: nothing decodes 100 tokens from now.
    capped = half.capped(100)
    assert (capped.mean, capped.var, capped.quantile) == (100, 2500, 100)
    assert dict(zip(HORIZON, capped.survival, strict=True))[128] == 0


def test_the_tier_default_and_full_reservations_are_known_remainders() -> None:
    estimates = _estimates([100] * 3)  # too few: the tier default less what it decoded
    assert estimates.outlook(ACME, "chat", POLICY, 200) == Outlook.exactly(312)
    full = make_policy(ACME, block_size=BLOCK, reservation={Tier.PREMIUM: ReservationMode.FULL})
    assert estimates.outlook(ACME, "chat", full, 200) is None
    # A known remainder counts whole blocks per sequence, as prompt + max_tokens does:
    # ceil((100 + 60) / 16) - ceil(100 / 16) = 3 blocks, and many add up in full.
    known = in_blocks(Outlook.exactly(60), (100,), 1, 0, BLOCK)
    assert known.bound == 3
    assert sum((known for _ in range(63)), NO_GROWTH).bound == 3 * 63


def _joint(n: int, outlook: Outlook, held: int) -> Remainder:
    one = in_blocks(outlook, (PROMPT,), 1, 0, BLOCK, held)
    return sum((one for _ in range(n)), NO_GROWTH)


def test_the_margin_grows_with_the_square_root_of_the_requests_not_their_number() -> None:
    """n requests alike, each still decoding 64 tokens from now with chance 1/2 (answers
    of 64 or 70 tokens, none decoded yet): 64 tokens on, each has grown 4 blocks or
    finished, so their joint growth there is 2n blocks on average with a standard
    deviation of 2 sqrt(n) (the window's error aside): the margin grows with sqrt(n)."""
    estimates = _estimates([64] * 32 + [70] * 32)
    fresh = estimates.outlook(ACME, "chat", POLICY, 0)
    assert fresh is not None and fresh.quantile == 70
    exact = Outlook(fresh.mean, fresh.var, fresh.quantile, fresh.survival, 10**9)  # no error
    at = HORIZON.index(64)
    for n in (16, 64, 256):
        joint = _joint(n, exact, 0)
        assert joint.grown[at] == pytest.approx(2 * n)
        assert Z * math.sqrt(joint.var[at] + joint.error[at] ** 2) == pytest.approx(
            Z * 2 * math.sqrt(n), rel=1e-3)
        # Below what their 90th percentiles charge (70 tokens, 4.4 blocks each).
        assert joint.bound < 4.4 * n
    # Few in flight: their own 90th percentiles are the bound (summed before rounding).
    assert _joint(MIN_JOINT - 1, fresh, 0).bound == math.ceil((MIN_JOINT - 1) * 70 / 16)
    # The window's error adds up linearly, not in quadrature: 64 answers read the chance
    # 1/2 within sqrt(1/4 / 64) = 1/16, so 4 / 16 blocks per request, all together.
    assert _joint(256, fresh, 0).error[at] == pytest.approx(256 * 4 / 16)


def test_the_charge_follows_requests_as_they_decode_and_finish() -> None:
    queue = AdmissionQueue(Ledger(), clock=lambda: 0.0, max_model_len=lambda: None)
    queue.set_policy(POLICY)
    for length in [100, 200, 300, 400, 500, 600, 700, 800, 900, 1000]:
        queue.estimates.observe("acme", "chat", length)
    ledger = queue.ledger
    first = queue.submit("acme", RequestShape((PROMPT,), 4096, route="chat"))
    assert first.reservation is not None
    # Alone: 6 prompt blocks plus its 90th percentile, 900 tokens (57 blocks).
    assert (ledger.committed_blocks("acme"), ledger.reserved_blocks("acme")) == (6, 63)
    first.reservation.progress(450)
    # 450 decoded fill 29 blocks (ceil(450 / 16)); past 450 its 90th percentile is
    # 550 more, 14 of them in its last block's free slots: ceil(536 / 16) = 34.
    assert ledger.committed_blocks("acme") == 6 + 29
    assert ledger.reserved_blocks("acme") == 6 + 29 + 34
    first.reservation.progress(460)  # within the same block: nothing moves
    assert ledger.reserved_blocks("acme") == 69
    others = [queue.submit("acme", RequestShape((PROMPT,), 4096, route="chat"))
              for _ in range(2 * MIN_JOINT)]
    assert all(t.reservation is not None for t in others)
    # Nine in flight are charged one joint bound, less than their 90th percentiles.
    assert ledger.reserved_blocks("acme") < 6 * 9 + 29 + 34 + 8 * 57
    first.reservation.release()
    for other in others:
        assert other.reservation is not None
        other.reservation.progress(2000)  # past every length: the tail stands in
        other.reservation.release()
    assert (ledger.reserved_blocks("acme"), ledger.tenants(), ledger.total_blocks) == (0, [], 0)


def test_n_in_flight_are_charged_well_below_their_p90s_and_rarely_outgrow_it() -> None:
    """Answers lognormal at sigma 0.8 (median 250 tokens) after 600-token prompts, the
    window learned from 64 of them; 32 requests in flight, caught at a random point of
    their answers (a request is in flight in proportion to its length); 100 trials.
    Each trial follows them to their ends and takes the peak of the blocks they hold
    together beyond what they hold now. Measured (seed 7): the joint bound is 0.32x what
    per-request 90th percentiles charged for their growth, and their peak outgrows it in
    2% of the trials."""
    rng = random.Random(7)

    def answer() -> int:
        return max(1, round(rng.lognormvariate(math.log(250), 0.8)))

    def blocks(tokens: int) -> int:
        return -(-tokens // BLOCK)

    n, trials, outgrown, charged, before = 32, 100, 0, 0, 0
    prompt = 600
    for _ in range(trials):
        estimates = _estimates([answer() for _ in range(WINDOW)])
        p90 = estimates.learned("acme", "chat")
        assert p90 is not None
        joint, flying = NO_GROWTH, []
        for _ in range(n):
            length = answer()
            while rng.random() >= length / 4096:
                length = answer()
            decoded = rng.randrange(length)
            own = blocks(prompt + decoded) - prompt // BLOCK  # what it gives back
            outlook = estimates.outlook(ACME, "chat", POLICY, decoded)
            assert outlook is not None
            joint += in_blocks(outlook.capped(4096 - decoded), (prompt,), 1, decoded, BLOCK,
                               own)
            flying.append((length, decoded, own))
            before += blocks(prompt + max(p90, decoded)) - blocks(prompt + decoded)
        peak = max(
            sum(blocks(prompt + d + ahead) - blocks(prompt + d) if length - d > ahead else -own
                for length, d, own in flying)
            for ahead in range(0, 4096, 16))
        outgrown += peak > joint.bound
        charged += joint.bound
    assert charged / before < 0.4
    assert outgrown / trials <= 0.05


def test_a_streamed_answer_moves_its_charge_as_its_token_events_pass() -> None:
    """The relay feeds the meter's running count to the reservation: a chat stream's
    token events, less the role event each choice opens with."""
    meter = OutputMeter("chat")
    meter.feed(b'data: {"role"}\n\n' + b'data: {"delta"}\n\n' * 40)
    assert meter.decoded() == 40
    assert OutputMeter("completion").decoded() == 0  # nothing streamed yet
