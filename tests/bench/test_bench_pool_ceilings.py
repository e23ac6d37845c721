"""A pool run says, per protected tenant, whether its own pool-wide maxBlocks held it
back (held at it, 429s on it) or admission did while it had room."""

from __future__ import annotations

from kvquota_lab.bench.pool_ceilings import PoolCeilings
from kvquota_lab.bench.pool_report import format_pool_table


def _ceilings() -> PoolCeilings:
    ceilings = PoolCeilings(10.0, {"devshop": ("premium", 1000), "hob": ("free", 500)})
    ceilings.sample(0.0, {}, {}, {})
    ceilings.sample(4.0, {"devshop": 950}, {"devshop": 990}, {"devshop": 2})  # at max
    ceilings.sample(6.0, {"devshop": 1100}, {"devshop": 500}, {"devshop": 1})  # room
    ceilings.sample(30.0, {"devshop": 10}, {}, {})  # past the load window: 4 s count
    ceilings.refused("devshop", 990, 40)  # would pass maxBlocks: the quota binds
    ceilings.refused("devshop", 500, 40)  # fits: refused with room
    return ceilings


def test_seconds_at_the_pool_wide_maximum_and_refusals_with_room() -> None:
    devshop = _ceilings().to_json()["devshop"]
    assert devshop["secondsAtMaxBlocks"] == 6.0  # 950 >= 90% of 1000, then 1100
    assert devshop["secondsAboveMaxBlocks"] == 2.0
    assert devshop["peakHeld"] == 1100
    assert (devshop["secondsQueued"], devshop["secondsQueuedWithRoom"]) == (6.0, 2.0)
    assert (devshop["refusedOnMaxBlocks"], devshop["refusedWithRoom"]) == (2, 1)


def test_the_pool_table_says_it_per_run() -> None:
    own = _ceilings().to_json()
    document = {
        "scenario": {"duration": 10.0}, "comparison": {"tier": "premium"},
        "run": {"wallSeconds": {}}, "pool": {"replicas": 8, "router": "prefix-affinity"},
        "policies": {"kvquota:demand:signals": {
            "tiers": {"premium": {"ttftP99": 3.0, "refusedWithinGuarantee": 0,
                                  "besideIdleKvSeconds": 0.0}},
            "extra": {"pool": {"ownMaxBlocks": own}}, "throughput": 1.0}},
    }
    line = format_pool_table(document).splitlines()[-1]
    assert line == ("  kvquota:demand:signals: premium at its own pool-wide maxBlocks: devshop "
                    "6 s (peak 1,100 of 1,000) of 10 s; above it 2 s; 429 on it 2 (1 with "
                    "room); queued 6 s (2 s with room); beside idle KV 0 s")
