"""`hvdtrain runs` and `hvdtrain show` on run directories written here: the status each kind of
ending gets, the row, the listing, and curves.png. No ranks start."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from PIL import Image

from hvdtrain.cli import main
from hvdtrain.job.execute import record_end
from hvdtrain.records import runs
from hvdtrain.records import view as runs_view
from hvdtrain.records.runs import RunFacts, run_status
from hvdtrain.records.view import run_row

HOST = socket.gethostname()
STARTED = "2026-03-01T10:00:00+00:00"
EPOCHS = [
    {"step": 0, "lr": 0.05},
    {"step": 1, "lr": 0.075},
    {"epoch": 1, "loss": 1.5, "test_accuracy": 0.8, "lr": 0.1, "samples_per_sec": 21000.5, "world_size": 2},
    {"epoch": 2, "loss": 0.5, "test_accuracy": None, "lr": 0.1, "samples_per_sec": None, "world_size": 2},
    {"epoch": 3, "loss": 0.25, "test_accuracy": 0.9, "lr": 0.1, "samples_per_sec": 30000.0, "world_size": 2},
]
SUMMARY = {"recipe": "digits-mlp-torch", "strategy": "horovod", "world_size": 2, "test_accuracy": 0.96}
SUMMARY |= {"final_loss": 0.039, "samples_per_sec": 40205.4, "hosts": [HOST, HOST], "epochs": 3}
BASE = {"recipe": "digits-mlp-torch", "framework": "torch", "strategy": "horovod"}


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def write_run(
    path: Path,
    record: dict | None = None,
    summary: dict | None = None,
    metrics: list | str | None = EPOCHS,
) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"epochs": 3, "lr": 0.05, "checkpoint": True}))
    if record is not None:
        (path / "run.json").write_text(json.dumps(record))
    if summary is not None:
        (path / "summary.json").write_text(json.dumps(summary))
    if isinstance(metrics, list):
        (path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in metrics))
    elif isinstance(metrics, str):
        (path / "metrics.jsonl").write_text(metrics)
    return path


def running(pid: int, host: str = HOST, started: str | None = None) -> dict:
    return {**BASE, "status": "running", "pid": pid, "host": host, "started": started or _began(pid)}


def _began(pid: int) -> str:
    """When the process began, as its record says it: the clock it is compared with (psutil's
    start times are boot time plus ticks, which a stepped wall clock leaves seconds apart from
    now_iso() on a busy machine)."""
    import datetime

    import psutil

    try:
        created = psutil.Process(pid).create_time()
    except psutil.Error:
        return runs.now_iso()
    return datetime.datetime.fromtimestamp(created).astimezone().isoformat(timespec="seconds")


def ended(status: str, exit_code: int, **more) -> dict:
    return {
        **BASE,
        "status": status,
        "pid": 1,
        "host": HOST,
        "started": STARTED,
        "exit_code": exit_code,
    } | more


@pytest.mark.parametrize(
    ("record", "has_summary", "pid_alive", "expected"),
    [
        ({"status": "finished"}, True, None, "finished"),
        ({"status": "failed", "exit_code": 3}, False, None, "failed"),
        ({"status": "failed", "exit_code": 3}, True, None, "failed"),  # rank 0 finished, the job did not
        ({"status": "interrupted", "signal": "SIGTERM"}, False, None, "interrupted"),
        ({"status": "running"}, False, True, "running"),
        ({"status": "running"}, False, False, "interrupted"),  # hvdtrain was SIGKILLed
        ({"status": "running"}, True, False, "interrupted"),  # a resume killed after an earlier finish
        ({"status": "running"}, False, None, "running"),  # another host's record: not checkable here
        ({"recipe": "digits-mlp-torch"}, True, None, "finished"),  # older hvdtrain: no status
        ({"recipe": "digits-mlp-torch"}, False, None, "unknown"),
        (None, True, None, "finished"),
        (None, False, None, "unknown"),
    ],
)
def test_status_table(record, has_summary, pid_alive, expected):
    assert run_status(record, has_summary, pid_alive) == expected


@pytest.mark.parametrize(
    ("previous", "resume", "started", "first_started"),
    [
        (None, False, "T2", None),  # a new run
        ({**BASE, "status": "finished", "pid": 7, "host": HOST, "started": "T1"}, False, "T2", None),
        ({**BASE, "status": "failed", "pid": 7, "host": HOST, "started": "T1"}, True, "T2", "T1"),  # --resume
        (
            {**BASE, "status": "running", "pid": 42, "host": HOST, "started": "T1"},
            True,
            "T1",
            None,
        ),  # restart
        ({**BASE, "pid": 9, "host": HOST, "started": "T1", "first_started": "T0"}, True, "T2", "T0"),
    ],
)
def test_running_record_keeps_the_runs_first_start(previous, resume, started, first_started):
    record = runs.running_record(BASE, previous, pid=42, host=HOST, now="T2", resume=resume)
    assert record == {**BASE, "status": "running", "pid": 42, "host": HOST, "started": started} | (
        {"first_started": first_started} if first_started else {}
    )


@pytest.mark.parametrize(
    ("exit_code", "stopped_by", "expected"),
    [
        (0, None, {"status": "finished", "exit_code": 0}),
        (3, None, {"status": "failed", "exit_code": 3}),
        (143, 15, {"status": "interrupted", "exit_code": 143, "signal": "SIGTERM"}),
        (130, 2, {"status": "interrupted", "exit_code": 130, "signal": "SIGINT"}),
    ],
)
def test_ended_record(exit_code, stopped_by, expected):
    record = runs.running_record(BASE, None, pid=42, host=HOST, now="T1", resume=False)
    assert runs.ended_record(record, exit_code, stopped_by, "T2") == {
        **record,
        "ended": "T2",
        **expected,
    }


def test_record_end_closes_only_this_processs_running_record(tmp_path):
    mine = write_run(tmp_path / "mine", record=running(os.getpid()))
    record_end(mine, 3, None)
    closed = json.loads((mine / "run.json").read_text())
    assert closed["status"] == "failed" and closed["exit_code"] == 3 and "ended" in closed
    other = write_run(tmp_path / "other", record=running(os.getpid() + 1))
    before = (other / "run.json").read_bytes()
    record_end(other, 0, None)
    assert (other / "run.json").read_bytes() == before
    done = write_run(tmp_path / "done", record=ended("finished", 0))
    before = (done / "run.json").read_bytes()
    record_end(done, 1, None)
    assert (done / "run.json").read_bytes() == before


@pytest.mark.parametrize(
    ("record", "summary", "status", "accuracy", "loss"),
    [
        (ended("finished", 0), SUMMARY, "finished", 0.96, 0.039),
        (ended("failed", 3), None, "failed", 0.9, 0.25),  # where it got to: the last epoch
        (ended("interrupted", 143, signal="SIGTERM"), None, "interrupted", 0.9, 0.25),
        (running(os.getpid()), None, "running", 0.9, 0.25),
        (running(_dead_pid()), None, "interrupted", 0.9, 0.25),
        (running(os.getpid(), started="2000-01-01T00:00:00+00:00"), None, "interrupted", 0.9, 0.25),  # reused
        (running(4_000_000, host="elsewhere"), None, "running", 0.9, 0.25),
        ({"recipe": "digits-mlp-torch"}, SUMMARY, "finished", 0.96, 0.039),
        (None, None, "unknown", 0.9, 0.25),
    ],
)
def test_run_directories_read_into_rows(tmp_path, record, summary, status, accuracy, loss):
    row = run_row(runs.read_run(write_run(tmp_path / "run", record, summary), HOST))
    assert (row.status, row.test, row.final_loss, row.world_size) == (status, ("accuracy", accuracy), loss, 2)
    assert row.name == "run" and row.strategy in ("horovod", "-") and row.started is not None


def test_started_from_the_record_else_the_directory_name(tmp_path):
    named = write_run(tmp_path / "digits-mlp-torch-20260102-030405", metrics=None)
    assert runs_view.run_started(runs.read_run(named, HOST)).strftime("%Y%m%d-%H%M%S") == "20260102-030405"
    resumed = {**ended("finished", 0), "first_started": "2026-01-01T00:00:00+00:00"}
    first = runs_view.run_started(runs.read_run(write_run(tmp_path / "resumed", resumed), HOST))
    assert first.isoformat() == "2026-01-01T00:00:00+00:00"


def test_a_resumed_epoch_keeps_its_later_record_and_step_records_are_left_out():
    text = "".join(
        json.dumps(line) + "\n"
        for line in [*EPOCHS, {"epoch": 3, "loss": 0.2, "lr": 0.1}, {"epoch": 4, "loss": 0.1, "lr": 0.1}]
    )
    epochs, problem = runs.parse_metrics(text)
    assert problem is None and [e["epoch"] for e in epochs] == [1, 2, 3, 4] and epochs[2]["loss"] == 0.2


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ('{"epoch": 1, "loss": 1.0}\n{"epoch": 2, "lo', "metrics.jsonl line 2 is damaged"),
        ('{"epoch": 1, "loss": 1.0}\n[1, 2]\n', "metrics.jsonl line 2 is damaged"),
        ('{"epoch": "one", "loss": 1.0}\n', "metrics.jsonl line 1: bad epoch 'one'"),
    ],
)
def test_damaged_metrics_are_named_by_line(text, problem):
    assert runs.parse_metrics(text)[1] == problem


def test_the_listing_is_oldest_first_and_has_no_scientific_notation(tmp_path):
    older = write_run(
        tmp_path / "a-20260101-000000", ended("failed", 1), metrics=[{"epoch": 1, "loss": 2e-7}]
    )
    newer = write_run(tmp_path / "b-20260102-000000", ended("finished", 0), SUMMARY)
    older_record = json.loads((older / "run.json").read_text()) | {"started": "2026-01-01T00:00:00+00:00"}
    (older / "run.json").write_text(json.dumps(older_record))
    (newer / "run.json").write_text(
        json.dumps(ended("finished", 0) | {"started": "2026-01-02T00:00:00+00:00"})
    )
    rows = [run_row(runs.read_run(path, HOST)) for path in runs.find_runs(tmp_path)]
    lines = runs_view.render_rows(list(reversed(rows))).splitlines()
    assert lines[0].split() == ["RECIPE", "STRATEGY", "NP", "STATUS", "TEST", "LOSS", "STARTED", "RUN"]
    assert lines[1].endswith("a-20260101-000000") and " failed " in lines[1] and "0.0000002 " in lines[1]
    assert lines[2].endswith("b-20260102-000000") and " finished " in lines[2]
    assert " accuracy 0.96 " in lines[2]
    assert "e-" not in "\n".join(lines) and "e+" not in "\n".join(lines)


def test_runs_show_and_list_speak_json_for_programs(tmp_path):
    failed = write_run(
        tmp_path / "a-20260101-000000", ended("failed", 1), metrics=[{"epoch": 1, "loss": 2.0}]
    )
    done = write_run(tmp_path / "b-20260102-000000", ended("finished", 0), SUMMARY)
    listed = CliRunner().invoke(main, ["runs", str(tmp_path), "--json"])
    assert listed.exit_code == 0, listed.output
    rows = {row["name"]: row for row in json.loads(listed.stdout)}
    assert rows[done.name] | {"started": None} == {
        "path": str(done), "name": done.name, "recipe": "digits-mlp-torch", "strategy": "horovod",
        "world_size": 2, "status": "finished", "test_metric": "test_accuracy", "test_value": 0.96,
        "final_loss": 0.039, "started": None, "slurm": None,
    }  # fmt: skip
    assert rows[failed.name]["status"] == "failed" and rows[failed.name]["final_loss"] == 2.0
    (tmp_path / "empty").mkdir()
    assert json.loads(CliRunner().invoke(main, ["runs", str(tmp_path / "empty"), "--json"]).stdout) == []
    shown = CliRunner().invoke(main, ["show", str(done), "--json"])
    whole = json.loads(shown.stdout)
    assert whole["summary"] == SUMMARY and whole["config"]["lr"] == 0.05 and len(whole["epochs"]) == 3
    assert not (done / "curves.png").exists(), "--json draws nothing"
    recipes = {
        recipe["name"]: recipe for recipe in json.loads(CliRunner().invoke(main, ["list", "--json"]).stdout)
    }
    assert (
        recipes["digits-mlp-torch"]["framework"] == "torch"
        and "debug" in recipes["digits-mlp-torch"]["variants"]
    )
    assert recipes["digits-mlp-torch"]["config"]["epochs"] > 0


def test_show_prints_the_run_and_writes_a_four_panel_png_changing_nothing_else(tmp_path):
    run_dir = write_run(tmp_path / "run", ended("interrupted", 143, signal="SIGTERM"), SUMMARY)
    before = {path.name: path.read_bytes() for path in run_dir.iterdir()}
    result = CliRunner().invoke(main, ["show", str(run_dir)])
    assert result.exit_code == 0, result.output
    assert "interrupted (by SIGTERM, exit code 143)" in result.output
    assert re.search(r"^  samples_per_sec +40,205$", result.output, re.MULTILINE), result.output
    assert re.search(r"^  lr +0.05$", result.output, re.MULTILINE)  # config values as --set takes them
    assert {path.name: path.read_bytes() for path in run_dir.iterdir() if path.name != "curves.png"} == before
    with Image.open(run_dir / "curves.png") as image:
        assert image.format == "PNG" and image.size == (1000, 700)
        image.verify()
    assert not list(run_dir.glob(".hvdtrain-tmp-*"))


def test_the_curves_have_four_titled_labelled_panels():
    facts = RunFacts(path=Path("r"), epochs=runs.parse_metrics("\n".join(map(json.dumps, EPOCHS)))[0])
    figure = runs_view.curves_figure(facts.epochs, runs_view.curves_title(facts))
    assert [ax.get_title() for ax in figure.axes] == [title for _, title, _ in runs_view.panels(facts.epochs)]
    assert figure.axes[1].get_title() == "Test accuracy"
    assert all(ax.get_xlabel() == "epoch" and ax.get_ylabel() for ax in figure.axes)
    lr_line = figure.axes[2].get_lines()[0]
    assert list(lr_line.get_xdata()) == [1, 2, 3]  # per epoch; warmup step records are left out
    throughput = figure.axes[3].get_lines()[0].get_ydata()
    assert throughput[0] == 21000.5 and throughput[1] != throughput[1]  # a null is a gap (nan)


def test_a_metric_never_recorded_says_so_in_its_panel():
    figure = runs_view.curves_figure(({"epoch": 1, "loss": 1.0}, {"epoch": 2, "loss": 0.5}), "ps run")
    assert [text.get_text() for text in figure.axes[2].texts] == ["not recorded"]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda tmp: tmp / "missing", "no such directory"),
        (lambda tmp: (tmp / "file").write_text("x") and tmp / "file", "is a file, not a run directory"),
        (lambda tmp: (tmp / "empty").mkdir() or tmp / "empty", "is not a run directory"),
        (
            lambda tmp: write_run(tmp / "bad", ended("failed", 1), metrics='{"epoch": 1}\n{"ep'),
            "line 2 is damaged",
        ),
        (
            lambda tmp: write_run(tmp / "bad") and (tmp / "bad/run.json").write_text("{") and tmp / "bad",
            "damaged",
        ),
    ],
)
def test_show_of_a_bad_run_dir_is_one_line_exit_2(tmp_path, make, message):
    run_dir = make(tmp_path)
    before = sorted(tmp_path.rglob("*"))
    result = CliRunner().invoke(main, ["show", str(run_dir)])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("hvdtrain: error:"), (
        result.output
    )
    assert message in lines[0]
    assert sorted(tmp_path.rglob("*")) == before


def test_show_without_matplotlib_says_so_in_one_line_and_shows_the_run(tmp_path, monkeypatch):
    run_dir = write_run(tmp_path / "run", ended("failed", 1, rank_exit_code=2), SUMMARY)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as where the extra is not installed
    result = CliRunner().invoke(main, ["show", str(run_dir)])
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    assert "failed (exit code 1; a rank's 2)" in result.output
    assert result.output.strip().splitlines()[-1] == (
        "curves: not drawn: matplotlib is not installed (pip install 'hvdtrain[plot]')"
    )
    assert not (run_dir / "curves.png").exists()


def test_show_of_a_run_without_epochs_writes_no_curves(tmp_path):
    run_dir = write_run(tmp_path / "run", running(_dead_pid()), metrics=None)
    result = CliRunner().invoke(main, ["show", str(run_dir)])
    assert result.exit_code == 0 and "curves: none yet" in result.output
    assert not (run_dir / "curves.png").exists()


def test_runs_lists_a_folder_or_one_run_and_names_damage(tmp_path):
    write_run(tmp_path / "good", ended("finished", 0), SUMMARY)
    write_run(tmp_path / "bad", ended("failed", 1), metrics='{"epoch": 1, "loss": 0.5}\n{"ep')
    (tmp_path / "not-a-run").mkdir()
    listed = CliRunner().invoke(main, ["runs", "--dir", str(tmp_path)])
    assert listed.exit_code == 0, listed.output
    assert len(listed.stdout.splitlines()) == 3 and "not-a-run" not in listed.stdout
    assert "bad/metrics.jsonl line 2 is damaged" in listed.stderr
    one = CliRunner().invoke(main, ["runs", str(tmp_path / "good")])
    assert one.exit_code == 0 and one.stdout.splitlines()[1].split()[3] == "finished"


@pytest.mark.parametrize(
    ("args", "code", "text"),
    [
        (["--dir", "{tmp}/missing"], 2, "hvdtrain: error: --dir {tmp}/missing: no such folder"),
        (["{tmp}/missing"], 2, "hvdtrain: error: {tmp}/missing: no such folder"),
        (["--dir", "{tmp}"], 0, "no runs: {tmp} holds no run directory"),
        ([], 0, "no runs: runs does not exist"),  # the default folder: nothing has run here yet
    ],
)
def test_runs_of_an_empty_or_missing_folder_is_one_line(tmp_path, monkeypatch, args, code, text):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["runs", *(arg.format(tmp=tmp_path) for arg in args)])
    assert result.exit_code == code and result.output.splitlines() == [text.format(tmp=tmp_path)]
