"""`hvdtrain bench`'s harness (hvdtrain/measure/bench.py), without running a benchmark."""

from __future__ import annotations

import pytest


def test_a_failed_benchmark_run_is_retried_once_then_fatal(capsys):
    from hvdtrain.measure.bench import BenchError, retried_once

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
    from hvdtrain.measure.bench import BenchError, retried_once

    def refused(attempt: int) -> float:
        raise BenchError(f"attempt {attempt}", code)

    with pytest.raises(BenchError, match="attempt 0"):
        retried_once(refused)


def test_the_plot_is_a_titled_png_drawn_without_a_display(tmp_path):
    import matplotlib
    from PIL import Image

    from hvdtrain.measure.bench import Row, plot

    rows = [
        Row("digits-mlp-torch", strategy, launcher, np_, 1000.0 * np_, 1.0)
        for strategy, launcher in (("horovod", "gloo"), ("ddp", "-"))
        for np_ in (1, 2, 4)
    ]
    plot(rows, tmp_path / "bench.png")
    assert matplotlib.get_backend().lower() == "agg"
    with Image.open(tmp_path / "bench.png") as image:
        assert image.format == "PNG" and image.size == (720, 480)
        image.verify()


def test_launcher_throughput_is_recorded_per_framework_for_launcher_auto(tmp_path):
    from hvdtrain.launchers.measurements import read_measurements
    from hvdtrain.measure.bench import Row, record_launchers

    path = tmp_path / "cache" / "launchers.json"
    assert read_measurements(path) == {}
    rows = [
        Row("synthetic-torch", "horovod", launcher, np_, rate * np_, 1.0)
        for launcher, rate in (("gloo", 100.0), ("mpi", 120.0))
        for np_ in (1, 2)
    ] + [Row("synthetic-torch", "ddp", "-", 2, 999.0, 1.0)]
    assert record_launchers(rows[:2], "torch", path) == {}, "one launcher compares nothing"
    assert not path.exists()
    record_launchers(rows, "tensorflow", path)
    assert record_launchers(rows, "torch", path) == read_measurements(path)
    assert read_measurements(path) == {
        "tensorflow": {"gloo": 200.0, "mpi": 240.0},
        "torch": {"gloo": 200.0, "mpi": 240.0},
    }, "the largest np, Horovod only, the other framework kept"
    assert [p.name for p in path.parent.iterdir()] == ["launchers.json"], "no temporary file left"
    path.write_text("{not json")
    assert read_measurements(path) == {}, "an unreadable file means nothing measured"
