"""The benchmark harness, without running a benchmark."""

from __future__ import annotations

import pytest


def test_a_failed_benchmark_run_is_retried_once_then_fatal(capsys):
    from hvdtrain.bench import BenchError, retried_once

    attempts = []

    def flaky(attempt: int) -> float:
        attempts.append(attempt)
        if attempt == 0:
            raise BenchError("benchmark run failed (-6): terminate called")
        return 42.0

    assert retried_once(flaky) == 42.0 and attempts == [0, 1]
    assert "a run failed and is run once more: benchmark run failed (-6)" in capsys.readouterr().err

    def broken(attempt: int) -> float:
        raise BenchError(f"failed {attempt}")

    with pytest.raises(BenchError, match="failed 1"):
        retried_once(broken)


@pytest.mark.parametrize("code", [2, 130, 143])
def test_bad_input_or_a_stop_is_not_retried(code):
    from hvdtrain.bench import BenchError, retried_once

    def refused(attempt: int) -> float:
        raise BenchError(f"attempt {attempt}", code)

    with pytest.raises(BenchError, match="attempt 0"):
        retried_once(refused)
