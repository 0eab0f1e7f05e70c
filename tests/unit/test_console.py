"""The console: every launcher's tags read back to a rank, human numbers, progress shown in place
on a terminal and as plain lines elsewhere."""

from __future__ import annotations

import io

import pytest

from hvdtrain.launching.console import Console, Line, human, parse
from hvdtrain.runtime.common import RunLog, epoch_line
from hvdtrain.runtime.progress import progress_record


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("[1,0]<stdout>:epoch 1/8  loss 0.5\n", Line(0, "stdout", "epoch 1/8  loss 0.5")),
        ("[1,1]<stderr>:warning: slow\n", Line(1, "stderr", "warning: slow")),
        # Open MPI tags a line's newline as a chunk of its own
        (
            "[1,0]<stdout>:epoch 1  30,000 samples/s[1,0]<stdout>:\n",
            Line(0, "stdout", "epoch 1  30,000 samples/s"),
        ),
        ("loss 0.5[1,1]<stdout>:\n", Line(1, "stdout", "loss 0.5")),
        ("[0]<stdout>:from gloo\n", Line(0, "stdout", "from gloo")),
        ("[12]<stderr>:from rank twelve\n", Line(12, "stderr", "from rank twelve")),
        ("[default1]:from torchrun\n", Line(1, "stdout", "from torchrun")),
        ("(BaseHorovodWorker pid=4242) [1]<stdout>:from ray\n", Line(1, "stdout", "from ray")),
        (
            "hvdtrain: --launcher auto chose mpi\n",
            Line(None, "stdout", "hvdtrain: --launcher auto chose mpi"),
        ),
    ],
)
def test_parse_reads_every_launchers_tags(raw, expected):
    assert parse(raw) == expected


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (32180.4, "32,180"),
        (1_234_567.0, "1,234,567"),
        (0.0764, "0.0764"),
        (0.22051, "0.2205"),
        (1e-05, "0.00001"),
        (2.5e-07, "0.00000025"),
        (0.1, "0.1"),
        (12.0, "12"),
        (999.96, "1,000"),
        (0.0, "0"),
        (None, "-"),
        (True, "yes"),
        (1200, "1,200"),
        (float("nan"), "nan"),
    ],
)
def test_human_numbers_have_no_exponent(value, text):
    assert human(value) == text


def test_epoch_lines_are_human():
    metrics = {
        "loss": 0.0764,
        "test_accuracy": 0.96,
        "lr": 1e-05,
        "samples_per_sec": 23970.4,
        "world_size": 2,
    }
    assert (
        epoch_line(8, 8, metrics)
        == "epoch 8/8  loss 0.0764  test_accuracy 0.96  lr 0.00001  23,970 samples/s"
    )


def feed(console: Console, lines: list[str]) -> None:
    for line in lines:
        console.feed(line)
    console.close()


def test_a_pipe_gets_plain_lines_rank_prefixes_and_no_tags():
    out = io.StringIO()
    record = progress_record(2, 8, 120, 400, 32180.0, 0.25, 42.0)
    feed(
        Console(out, live=False),
        [
            "hvdtrain: --launcher auto chose mpi\n",
            f"[1,0]<stdout>:{record}\n",
            f"[1,1]<stdout>:{record}\n",  # another rank's progress is never shown
            "[1,1]<stderr>:UserWarning: something\n",
            "[1,0]<stdout>:epoch 2/8  loss 0.25[1,0]<stdout>:\n",
        ],
    )
    assert out.getvalue().splitlines() == [
        "hvdtrain: --launcher auto chose mpi",
        "epoch 2/8  step 120/400  32,180 samples/s  ETA 0:42  loss 0.25",
        "[rank 1] UserWarning: something",
        "epoch 2/8  loss 0.25",
    ]


def test_hidden_lines_and_damaged_records_show_nothing():
    out = io.StringIO()
    feed(Console(out, live=False), ["[0]<stdout>:hvdtrain:progress {cut\n"])
    Console(out, live=False).feed("[0]<stdout>:noise\n", show=False)
    assert out.getvalue() == ""


def test_a_terminal_gets_a_bar_redrawn_in_place():
    out = io.StringIO()
    console = Console(out, live=True)
    for step in (100, 200, 300):
        console.feed(f"[0]<stdout>:{progress_record(1, 2, step, 400, 32180.0, 0.5, 10.0)}\n")
        console._progress.refresh()
    console.feed("[0]<stdout>:epoch 1/2  loss 0.5\n")
    console.close()
    shown = out.getvalue()
    assert "epoch 1/2" in shown and "300/400" in shown and "32,180 samples/s" in shown and "loss 0.5" in shown
    assert "\r" in shown or "\x1b[" in shown, "redrawn in place, not appended"
    assert "hvdtrain:progress" not in shown


def test_rank_zero_prints_progress_at_most_every_interval(tmp_path, capsys, monkeypatch):
    log = RunLog(tmp_path, True, "r", "horovod", 2, progress_every=10.0)
    clock = iter([100.0, 101.0, 115.0, 116.0])
    monkeypatch.setattr("hvdtrain.runtime.common.time.monotonic", lambda: next(clock))
    log.progress(0, 3, 5, 50, 640, 5.0, 0.9)  # 5 s into the epoch: too early
    log.progress(0, 3, 10, 50, 1280, 11.0, 0.8)  # shown
    log.progress(0, 3, 15, 50, 1920, 12.0, 0.7)  # 1 s after the last: not
    log.progress(0, 3, 40, 50, 5120, 26.0, 0.6)  # shown
    shown = [line for line in capsys.readouterr().out.splitlines() if line]
    assert len(shown) == 2 and all(line.startswith("hvdtrain:progress ") for line in shown)
    assert '"step": 10' in shown[0] and '"epoch": 1' in shown[0]
    RunLog(tmp_path, False, "r", "horovod", 2, progress_every=0.0).progress(0, 3, 10, 50, 1, 99.0, 0.1)
    RunLog(tmp_path, True, "r", "horovod", 2, progress_every=None).progress(0, 3, 10, 50, 1, 99.0, 0.1)
    assert capsys.readouterr().out == "", "other ranks and runs without HVDTRAIN_PROGRESS_S print none"


def test_lines_after_close_are_plain_and_a_bad_interval_means_no_progress():
    from hvdtrain.runtime.common import progress_interval

    out = io.StringIO()
    console = Console(out, live=True)
    console.feed(f"[0]<stdout>:{progress_record(1, 2, 100, 400, 32180.0, 0.5, 10.0)}\n")
    console.close()
    console.feed(f"[0]<stdout>:{progress_record(1, 2, 200, 400, 32180.0, 0.5, 10.0)}\n")  # a late reader
    console.feed("[0]<stdout>:epoch 1/2  loss 0.5\n")
    last = out.getvalue().splitlines()[-2:]  # after the bar's own clean-up codes
    assert last[0].endswith("\x1b[2Kepoch 1/2  step 200/400  32,180 samples/s  ETA 0:10  loss 0.5")
    assert last[1] == "epoch 1/2  loss 0.5"
    assert [progress_interval(v) for v in ("0.5", "", None, "abc", "-1")] == [0.5, None, None, None, None]


def test_a_loss_given_as_a_function_is_read_only_for_a_printed_record(tmp_path, capsys):
    calls = []
    log = RunLog(tmp_path, True, "r", "horovod", 2, progress_every=10.0)
    log.progress(0, 3, 5, 50, 640, 5.0, lambda: calls.append(1) or 0.9)  # too early: not read
    log.progress(0, 3, 10, 50, 1280, 11.0, lambda: calls.append(1) or 0.8)
    assert calls == [1] and '"loss": 0.8' in capsys.readouterr().out
