"""Fixtures for the scheduler-plugin tests: prompts, a policy path, a harness factory."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from plugin_policies import Tokens


@pytest.fixture
def tokens() -> Tokens:
    return Tokens()


@pytest.fixture
def policy_path(tmp_path: Path) -> Path:
    return tmp_path / "policy.json"


@pytest.fixture
def make_harness(tiny_model: Path) -> Iterator[Callable[..., object]]:
    """Build SchedulerHarness instances; shut them all down afterwards."""
    from kvquota_lab.twin.harness import SchedulerHarness, TwinConfig

    made: list[SchedulerHarness] = []

    def make(**kwargs: object) -> SchedulerHarness:
        harness = SchedulerHarness(TwinConfig(model_dir=tiny_model, **kwargs))  # type: ignore[arg-type]
        made.append(harness)
        return harness

    yield make
    for harness in made:
        harness.shutdown()
