"""What a user gets back: the table, the JSON file, the PNG, and clear CLI errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvquota.cli import main


def test_bench_writes_table_json_and_png(tiny_scenario: Path, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    out_json, out_png = tmp_path / "out" / "bench.json", tmp_path / "bench.png"
    code = main(["bench", "--scenario", str(tiny_scenario), "--jobs", "1",
                 "--json", str(out_json), "--plot", str(out_png)])
    assert code == 0
    printed = capsys.readouterr()
    for label in ("stock vLLM FCFS", "stock vLLM priority", "KVQuota", "baseline"):
        assert label in printed.out
    assert "premium TTFT p99 vs no-noise baseline" in printed.out
    assert "total throughput vs stock FCFS" in printed.out
    assert "100%" in printed.err or "requests" in printed.err  # progress
    document = json.loads(out_json.read_text())
    premium = document["policies"]["kvquota"]["tiers"]["premium"]
    for key in ("ttftP50", "ttftP95", "ttftP99", "tpotMean", "throughput", "goodput",
                "preemptions", "prefixHitRate", "leaseBreaks", "rejected429", "rejected503"):
        assert key in premium
    assert premium["leaseBreaks"] is not None
    assert document["policies"]["fcfs"]["tiers"]["premium"]["leaseBreaks"] is None
    assert len(premium["ttftCdf"]) == 101
    assert document["policies"]["kvquota"]["timeline"]["blocks"]["premium"]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_list_shows_scenarios_and_profiles(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "list"]) == 0
    out = capsys.readouterr().out
    for name in ("noisy-neighbour", "premium-idle-burst", "all-premium-saturation",
                 "steady-mixed", "a100-llama3-8b"):
        assert name in out


def test_a_broken_scenario_is_one_clear_line_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nduration: -5\nengine: {capacityBlocks: 100}\ntenants: {}\n")
    assert main(["bench", "--scenario", str(bad), "--jobs", "1"]) == 2
    err = capsys.readouterr().err
    assert "kvquota bench: invalid scenario" in err
    assert "duration: Input should be greater than 0" in err
    assert "Traceback" not in err


def test_an_unknown_profile_names_the_available_ones(
    tiny_scenario: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "--scenario", str(tiny_scenario), "--profile", "h100"]) == 2
    assert "no cost profile named 'h100'; available: a100-llama3-8b" in capsys.readouterr().err
