"""The project's own benchmark suite, `make bench` (`python -m benchmarks` from the repository root):
hvdtrain against hand-written Horovod, start-up overhead, scaling, allreduce bandwidth, the Gloo
patches, strategies and launchers, elastic recovery on namespace hosts, data from disk, a chaos run
of random faults on an elastic job. Every comparison is measured side by side in one run. Not part
of the package: it runs from a checkout, and takes the namespace rig from tests/support."""

from __future__ import annotations

from pathlib import Path

from hvdtrain.launching.rank_output import rank_json_records
from hvdtrain.measure.bench import BenchError, hvdtrain_run

PROGRAMS = Path(__file__).parent
"""The Horovod scripts the suite runs: hand-written baselines and the allreduce timer."""


def script_samples_per_sec(script: Path, np_: int, launcher: str, run_dir: Path, *script_args: str) -> float:
    """The samples/s a Horovod script printed as a JSON line, run by `hvdtrain run SCRIPT`."""
    hvdtrain_run(
        str(script), "--np", str(np_), "--launcher", launcher, run_dir=run_dir, script_args=script_args
    )
    for record in rank_json_records(run_dir / "logs"):
        if "samples_per_sec" in record:
            return float(record["samples_per_sec"])
    raise BenchError(f"{script.name} printed no samples_per_sec (logs: {run_dir / 'logs'})")
