"""The image runs the tests with a pytest that has no pytest-xdist: the project's conftest must load
there too (a hook of xdist's defined unconditionally stops pytest before it collects a test)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_tests_collect_without_xdist_as_the_image_runs_them():
    # -p no:xdist: xdist's hook specifications are never registered, as in the image
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", "--collect-only", "-q"]
        + ["tests/integration/test_build.py", "tests/unit/test_config.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert collected.returncode == 0, collected.stdout[-2000:] + collected.stderr[-2000:]
    assert "tests/integration/test_build.py::" in collected.stdout
