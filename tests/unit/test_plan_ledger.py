"""The planner's ledger: a prediction is compared with the first measurement of the same
topology, workload and rate taken after it."""

import pytest

from cluster.plan import ledger

pytestmark = pytest.mark.unit


def test_last_check_pairs_each_rate_with_the_measurement_after_its_prediction(tmp_path):
    path = tmp_path / "ledger.jsonl"
    figures = {"goodput_rps": 2.0, "attainment": 1.0, "ttft_p90_ms": 100.0, "tpot_p90_ms": 20.0}
    ledger.append("measurement", "1P+1D", "w", 2.0, {**figures, "goodput_rps": 9.0}, path)  # before: ignored
    ledger.append("prediction", "1P+1D", "w", 2.0, figures, path)
    ledger.append("prediction", "2C", "w", 2.0, figures, path)  # another topology
    ledger.append("measurement", "1P+1D", "w", 2.0, {**figures, "goodput_rps": 1.6, "ttft_p90_ms": 125.0}, path)
    ledger.append("prediction", "1P+1D", "w", 4.0, figures, path)  # not measured yet
    [(prediction, measured)] = ledger.last_check("1P+1D", "w", path)
    assert prediction["figures"]["goodput_rps"] == 2.0 and measured["figures"]["goodput_rps"] == 1.6
    [line] = ledger.describe_checks(ledger.last_check("1P+1D", "w", path))
    assert "at 2 req/s" in line and "goodput 2.00 req/s predicted, 1.60 req/s measured (+25%)" in line
    assert "TTFT p90 100 ms predicted, 125 ms measured (-20%)" in line
    assert ledger.last_check("1P+1D", "other workload", path) == []
