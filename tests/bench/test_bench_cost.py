"""Step-cost profiles: the published one is plausible, calibration recovers a machine."""

from __future__ import annotations

import pytest

from kvquota_lab.bench.calibrate import fit_profile
from kvquota_lab.bench.cost import load_profile


def test_a100_profile_matches_the_figures_it_cites() -> None:
    a100 = load_profile("a100-llama3-8b")
    prefill_2k = a100.step_seconds(prefill_tokens=2000, decode_seqs=0, context_tokens=2000)
    assert 0.15 < prefill_2k < 0.25  # ~10k prompt tokens/s
    decode_128 = a100.step_seconds(prefill_tokens=0, decode_seqs=128, context_tokens=128 * 2048)
    assert 0.03 < decode_128 < 0.06  # ~2-4k output tokens/s at 128 sequences
    assert a100.sources


def test_calibration_fit_recovers_a_known_step_cost() -> None:
    overhead, per_seq, attention, prefill = 0.004, 0.0003, 2e-7, 5e-5
    decode = [
        (b, ctx, overhead + per_seq * b + attention * b * ctx)
        for b in (1, 4, 16, 32) for ctx in (88, 792)
    ]
    http = 0.02  # every measured latency also pays HTTP and tokenisation
    samples = [(p, http + overhead + (prefill + attention) * p) for p in (64, 512, 1536)]
    profile = fit_profile(decode, samples)
    assert profile.overhead == pytest.approx(overhead, rel=1e-3)
    assert profile.decode_per_seq == pytest.approx(per_seq, rel=1e-3)
    assert profile.attention_per_context_token == pytest.approx(attention, rel=1e-3)
    assert profile.prefill_per_token == pytest.approx(prefill, rel=1e-3)
    assert profile.name == "cpu-local" and profile.calibrated_at is not None
