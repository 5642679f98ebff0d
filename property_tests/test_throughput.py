"""The harness's own speed measurement: the small-case mix and the cases-per-second figure."""

from __future__ import annotations

from parity.cli import main
from parity.throughput import measure, small_cases


def test_small_cases_are_a_deterministic_varied_mix():
    cases = small_cases(72)
    assert cases == small_cases(72) and len(set(cases)) == 72
    assert {c.input_layout for c in cases} == {c.weight_layout for c in cases} and len({c.dist for c in cases}) == 5
    assert max(max(c.M, c.K, c.N) for c in cases) <= 128


def test_measure_counts_every_case():
    result = measure(device="cpu", cases=6)
    assert result["cases"] == 6 and result["cases_per_second"] > 0
    assert set(result["phase_share"]) == {"data", "fp8_impl", "torchao:tensorwise", "emulated:tensorwise", "compare"}


def test_cli(capsys):
    assert main(["throughput", "--device", "cpu", "--cases", "4"]) == 0
    assert "cases/s: 4 small cases" in capsys.readouterr().out
