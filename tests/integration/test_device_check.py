"""The GPU machine's check (containers/device_check.py) run here at toy sizes, against this venv's
Horovod: its checks part cannot rot between the calls a GPU is lent for. `make device-rehearsal`
runs the whole of it, the offline Horovod build and every check included."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHECKS = (
    "doctor",
    "allreduce",
    "speed-gpt",
    "train-resnet-zero-bf16",
    "train-gpt-ddp-bf16",
    "resume-bitwise",
)


def test_the_device_checks_pass_at_toy_sizes_and_write_their_report(tmp_path):
    ran = subprocess.run(
        [
            sys.executable,
            "containers/device_check.py",
            "--toy",
            "--no-build",
            "--no-install",
            "--budget",
            "1500",
        ]
        + ["--only", ",".join(CHECKS), "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={k: v for k, v in os.environ.items() if k != "OUT"},  # the report where the test reads it
    )
    report = json.loads((tmp_path / "device-report.json").read_text())
    checks = {check["name"]: check for check in report["checks"]}
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-2000:]
    assert set(checks) == set(CHECKS) and all(c["status"] == "passed" for c in checks.values()), checks
    assert report["cuda"] is False and report["toy"] is True
    assert "| resume-bitwise | passed |" in (tmp_path / "device-report.md").read_text()

    speed = checks["speed-gpt"]["figures"]
    assert speed["plain_samples_per_sec"] > 0 and speed["hvdtrain_samples_per_sec"] > 0
    assert speed["hvdtrain_over_plain"] == speed["hvdtrain_samples_per_sec"] / speed["plain_samples_per_sec"]
    assert speed["tokens_per_sec"] == speed["hvdtrain_samples_per_sec"] * 64  # the debug GPT's context
    trained = checks["train-gpt-ddp-bf16"]["figures"]
    assert trained["loss_last"] < trained["loss_first"] and trained["compute_dtype"] == "bfloat16"
    resumed = checks["resume-bitwise"]["figures"]
    assert 0 < resumed["stopped_at_step"] < resumed["steps"], resumed
    assert checks["doctor"]["figures"]["verdict"].startswith("verdict: OK")
    assert "ALLREDUCE" in checks["allreduce"]["figures"]["timeline_activities"].split()
