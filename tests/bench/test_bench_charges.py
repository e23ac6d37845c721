"""The bench report's charge line: what admission charged each tenant beside what its
requests held, and when they outgrew their joint charge (README: reservations)."""

from __future__ import annotations

from kvquota_lab.bench.charges import ChargeLog, ChargeReading, charge_lines


def test_requests_holding_more_than_charged_a_reading_before_count_as_outgrown() -> None:
    log = ChargeLog(window=100.0)
    log.read(1.0, {"acme": ChargeReading(charged=120, held=80, reserved=110, admitted=50,
                                         inflight=4)})
    # Held 115 > 110 charged before plus 0 admitted since: outgrown.
    log.read(2.0, {"acme": ChargeReading(charged=130, held=115, reserved=125, admitted=50,
                                         inflight=4)})
    # Held 140 <= 125 + 20 admitted since: within its charge.
    log.read(3.0, {"acme": ChargeReading(charged=150, held=140, reserved=150, admitted=70,
                                         inflight=5)})
    log.read(200.0, {"acme": ChargeReading(charged=999, held=1, reserved=1, admitted=70,
                                           inflight=5)})  # after the load window
    acme = log.to_json()["acme"]
    assert (acme["readings"], acme["outgrownShare"]) == (3, round(1 / 3, 4))
    assert acme["meanCharged"] == 133.3 and acme["meanHeld"] == 111.7
    assert acme["chargedVsHeld"] == round(400 / 335, 3)
    line = charge_lines({"policies": {"kvquota": {"extra": {"charges": log.to_json()}},
                                      "priority": {"extra": {}}}})
    assert line == ["kvquota: charged vs held while in flight (mean blocks; share of stats "
                    "readings its requests held more than charged a reading before): "
                    "acme 1.19x (133 / 112, outgrown 33.3%)"]
