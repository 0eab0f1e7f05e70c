"""`make bench` section `eight-hosts`: functional runs on an eight-host namespace rig
(tests/support/rig.py), too long for `make test`'s budget. Tiny models, one rank a host unless told:
horovod over gloo and over MPI and ddp, ending with the same weights; hierarchical allreduce and
allgather on 4 hosts x 2 ranks against the flat run; Slurm with 8 nodes (tests/support/slurm.py);
an elastic job that loses two hosts at once (8 -> 6) and takes them back (-> 8). Each check prints
pass or fail with its figures; a failure makes the section fail."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from hvdtrain.measure.bench import BenchError, hvdtrain_run

HOSTS = 8
BRIDGE, SUBNET = "hvd9", "10.77.9.0/24"
"""Clear of the pytest workers' rigs (hvd0..hvd3 on 10.77.0-3.0/24)."""
RECIPE = ("digits-mlp-torch", "--variant", "debug")
"""A checkpoint at the end: its weights are compared across the paths."""
PATHS: dict[str, tuple[str, ...]] = {
    "horovod gloo": ("--strategy", "horovod", "--launcher", "gloo"),
    "horovod mpi": ("--strategy", "horovod", "--launcher", "mpi"),
    "ddp": ("--strategy", "ddp"),
}
SAME_MATH = (("horovod mpi", "mpi flat 4x2"), ("mpi flat 4x2", "mpi hierarchical 4x2"))
"""Runs whose weights must match bit for bit: the same gradients summed in the same order. Horovod
over MPI sums 8 ranks' gradients in one order wherever the ranks are placed and whether or not the
allreduce is hierarchical; gloo's ring and DDP's buckets sum in other orders, so across launchers
and strategies the weights agree to rounding (CLOSE), not to the bit."""
CLOSE = 1e-4
"""Largest difference of any weight between two runs that sum in different orders, relative to the
weights' largest magnitude."""


@dataclass
class Check:
    name: str
    passed: bool
    figures: str

    def line(self) -> str:
        return f"{'pass' if self.passed else 'FAIL':<5}{self.name:<44}{self.figures}"


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def trained_everywhere(found: dict, world_size: int, hostnames: Sequence[str]) -> list[str]:
    """What is wrong with a finished run's summary: its size, its consistency, the hosts it ran on."""
    problems = []
    if found.get("world_size") != world_size:
        problems.append(f"world_size {found.get('world_size')} != {world_size}")
    if found.get("weights_consistent") is not True:
        problems.append("weights_consistent is not true")
    if "hosts" in found and sorted(set(found["hosts"])) != sorted(set(hostnames)):
        problems.append(f"ran on {sorted(set(found['hosts']))}")
    return problems


def digest_verdicts(digests: dict[str, str], same: Sequence[tuple[str, str]] = SAME_MATH) -> list[str]:
    """A problem for each pair of paths that must end with the same weights and does not."""
    return [
        f"{a} and {b} differ ({digests[a][:12]} vs {digests[b][:12]})"
        for a, b in same
        if a in digests and b in digests and digests[a] != digests[b]
    ]


def _hosts_option(rig, slots: int, hosts: Sequence[int]) -> list[str]:
    from tests.support.rig import rig_host_args

    args = rig_host_args(rig, *hosts)
    args[args.index("--hosts") + 1] = ",".join(f"{rig.host(h).address}:{slots}" for h in hosts)
    return args


def weights_of(rig, run_dir: Path) -> list:
    """Rank 0's last checkpoint's weights: on the launching host, else on host 1's own disk."""
    from tests.support.helpers import final_weights

    for where in (run_dir, rig.private_disk(1) / run_dir.name):
        if (where / "checkpoints").exists():
            return final_weights(where)
    raise BenchError(f"no checkpoint of {run_dir.name}")


def largest_difference(a: Sequence, b: Sequence) -> float:
    """The largest difference of any weight, relative to the largest weight's magnitude."""
    import numpy as np

    scale = max(float(np.abs(x).max()) for x in a) or 1.0
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True)) / scale


def paths_agree(rig, out: Path, digests: dict[str, str]) -> list[Check]:
    """horovod gloo, horovod mpi and ddp on 8 hosts x 1 rank: each trains everywhere; their weights
    against horovod mpi's."""
    from tests.support.rig import rig_host_args

    checks, weights = [], {}
    hostnames = [host.hostname for host in rig.hosts]
    for name, args in PATHS.items():
        run_dir = rig.disk / f"eight-{name.replace(' ', '-')}"
        started = time.monotonic()
        try:
            hvdtrain_run(
                *RECIPE[:1], *rig_host_args(rig, *range(1, HOSTS + 1)), *RECIPE[1:], *args, run_dir=run_dir
            )
        except BenchError as error:
            checks.append(Check(f"{name}, 8 hosts x 1", False, str(error).splitlines()[0][:200]))
            continue
        found = summary(run_dir)
        problems = trained_everywhere(found, HOSTS, hostnames)
        digests[name] = found.get("parameter_digest", "")
        figures = (
            f"{time.monotonic() - started:.0f} s, accuracy {found.get('test_accuracy', float('nan')):.3f}, "
            f"{found.get('steady_samples_per_sec', 0):.0f} samples/s, digest {digests[name][:12]}"
        )
        checks.append(Check(f"{name}, 8 hosts x 1", not problems, "; ".join([figures, *problems])))
        weights[name] = weights_of(rig, run_dir)
        _keep(run_dir, out)
    if "horovod mpi" in weights:
        for name in (n for n in weights if n != "horovod mpi"):
            found = largest_difference(weights[name], weights["horovod mpi"])
            same = digests[name] == digests["horovod mpi"]
            checks.append(
                Check(
                    f"{name} weights vs horovod mpi",
                    found <= CLOSE,
                    f"{'identical' if same else 'differ'}: largest difference {found:.1e} of the largest "
                    f"weight (goal <= {CLOSE:g}: another summation order)",
                )
            )
    return checks


def hierarchical(rig, out: Path, digests: dict[str, str]) -> list[Check]:
    """4 hosts x 2 ranks over MPI, flat and with hierarchical allreduce and allgather: both train,
    and what each took."""
    checks = []
    hostnames = [rig.host(h).hostname for h in range(1, 5)]
    for name, flags, env in (
        ("flat", (), {}),
        ("hierarchical", ("--hierarchical-allreduce",), {"HOROVOD_HIERARCHICAL_ALLGATHER": "1"}),
    ):
        run_dir = rig.disk / f"eight-{name}"
        started = time.monotonic()
        try:
            hvdtrain_run(
                *RECIPE[:1], *_hosts_option(rig, 2, range(1, 5)), *RECIPE[1:], "--strategy", "horovod",
                "--launcher", "mpi", *flags, run_dir=run_dir, env={**os.environ, **env},
            )  # fmt: skip
        except BenchError as error:
            checks.append(Check(f"{name}, 4 hosts x 2 (mpi)", False, str(error).splitlines()[0][:200]))
            continue
        found = summary(run_dir)
        digests[f"mpi {name} 4x2"] = found.get("parameter_digest", "")
        problems = trained_everywhere(found, 8, hostnames)
        figures = (
            f"{time.monotonic() - started:.0f} s, accuracy {found.get('test_accuracy', float('nan')):.3f}, "
            f"{found.get('steady_samples_per_sec', 0):.0f} samples/s, "
            f"digest {digests[f'mpi {name} 4x2'][:12]}"
        )
        checks.append(Check(f"{name}, 4 hosts x 2 (mpi)", not problems, "; ".join([figures, *problems])))
        _keep(run_dir, out)
    pairs = [(a, b) for a, b in SAME_MATH if a in digests and b in digests]
    if pairs:
        problems = digest_verdicts(digests, pairs)
        checks.append(
            Check(
                "same weights, bit for bit",
                not problems,
                "; ".join(problems) or "; ".join(f"{a} = {b} ({digests[a][:12]})" for a, b in pairs),
            )
        )
    return checks


def slurm_eight_nodes(rig, out: Path, digests: dict[str, str]) -> list[Check]:
    """An sbatch script of one `hvdtrain run` line on 8 nodes x 1 task, no --hosts."""
    from tests.support.slurm import SlurmCluster

    name = f"eight-slurm-{os.getpid()}"
    run_dir = rig.disk / name
    script = "\n".join(
        [
            "#!/bin/bash",
            f"#SBATCH --nodes={HOSTS}",
            "#SBATCH --ntasks-per-node=1",
            f"#SBATCH --output={run_dir}.out",
            f"exec {sys.executable} -m hvdtrain run {' '.join(RECIPE)} --run-dir {run_dir}",
            "",
        ]
    )
    started = time.monotonic()
    with SlurmCluster(rig, hosts=HOSTS) as slurm:
        done = slurm.run(["sbatch", "--parsable"], input=script, timeout=60)
        if done.returncode != 0:
            return [Check("slurm, 8 nodes x 1", False, f"sbatch failed: {done.stderr.strip()[:200]}")]
        job = done.stdout.strip().split(";")[0]
        final = slurm.wait_job_gone(job, timeout=600)
    on_node_1 = rig.private_disk(1) / name
    if final.get("JobState") != "COMPLETED" or not (on_node_1 / "summary.json").exists():
        output = Path(f"{on_node_1}.out")
        tail = output.read_text(errors="replace")[-400:] if output.exists() else ""
        return [Check("slurm, 8 nodes x 1", False, f"job {job} {final.get('JobState')}: {tail}")]
    found = summary(on_node_1)
    problems = trained_everywhere(found, HOSTS, [host.hostname for host in rig.hosts])
    figures = (
        f"job {job} COMPLETED in {time.monotonic() - started:.0f} s, accuracy "
        f"{found.get('test_accuracy', float('nan')):.3f}, digest {found.get('parameter_digest', '')[:12]}"
    )
    _keep(on_node_1, out)
    return [Check("slurm, 8 nodes x 1 (sbatch, srun)", not problems, "; ".join([figures, *problems]))]


def elastic_eight_six_eight(rig, out: Path, digests: dict[str, str]) -> list[Check]:
    """An elastic job on 8 hosts; two hosts without rank 0 lose their links at once; the job must
    train on at 6, then at 8 again once the links are back. Times from the fault."""
    from tests.support.elastic import ElasticJob, logged_after

    output = out / "elastic-8.log"
    job = ElasticJob(rig, "eight-elastic", epochs=100_000, hosts=tuple(range(1, HOSTS + 1)), output=output)
    lost: list[int] = []
    try:
        job.wait_for(lambda sizes: len(sizes) >= 3 and sizes[-1] == HOSTS, 300, "eight ranks training")
        before = len(job.sizes)
        lost = [h for h in range(HOSTS, 0, -1) if h != job.chief_host][:2]
        for host in lost:
            rig.link_down(host)
        try:
            shrunk = job.wait_for(logged_after(before, HOSTS - 2), 180, "training on at six")
        finally:
            for host in lost:
                rig.link_up(host)
        grown = job.wait_for(logged_after(len(job.sizes), HOSTS), 300, "both hosts taken back")
        sizes = job.sizes
    except RuntimeError as error:
        what = str(error).split(";")[0]
        return [
            Check("elastic 8 -> 6 -> 8", False, f"{what}; lost hosts {lost}; world sizes {_runs(job.sizes)}")
        ]
    finally:
        for host in lost:
            rig.link_up(host)
        job.stop()
    figures = (
        f"hosts {lost} down at once: training at 6 after {shrunk:.1f} s, at 8 again {grown:.1f} s "
        f"after the links came back; world sizes logged {_runs(sizes)}"
    )
    return [Check("elastic 8 -> 6 -> 8", True, figures)]


def _runs(sizes: Sequence[int]) -> str:
    """1,8,8,8,6,6,8 -> '8x3 6x2 8x1' (size x epochs, in order)."""
    parts: list[list[int]] = []
    for size in sizes:
        if parts and parts[-1][0] == size:
            parts[-1][1] += 1
        else:
            parts.append([size, 1])
    return " ".join(f"{size}x{count}" for size, count in parts)


def _keep(run_dir: Path, out: Path) -> None:
    import shutil

    if run_dir.exists():
        shutil.copytree(
            run_dir, out / run_dir.name, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.pt")
        )


CHECKS: dict[str, Callable] = {
    "paths": paths_agree,
    "hierarchical": hierarchical,
    "slurm": slurm_eight_nodes,
    "elastic": elastic_eight_six_eight,
}
"""In the order they run; EIGHT_HOSTS_CHECKS (comma-separated) picks some."""


def main(out: Path, chosen: Sequence[str] | None = None) -> list[Check]:
    from tests.support.rig import Rig

    if chosen is None:
        chosen = [
            n.strip() for n in os.environ.get("EIGHT_HOSTS_CHECKS", "").split(",") if n.strip()
        ] or list(CHECKS)
    if unknown := [name for name in chosen if name not in CHECKS]:
        raise BenchError(f"unknown eight-hosts check {', '.join(unknown)}; of {', '.join(CHECKS)}")
    out.mkdir(parents=True, exist_ok=True)
    checks: list[Check] = []
    digests: dict[str, str] = {}  # run -> parameter_digest, shared by the checks
    with Rig(hosts=HOSTS, bridge=BRIDGE, subnet=SUBNET) as rig:
        for name in chosen:
            try:
                found = CHECKS[name](rig, out, digests)
            except Exception as error:  # a check that breaks is a failed check; the others still run
                found = [Check(name, False, f"{type(error).__name__}: {str(error).splitlines()[0][:300]}")]
            for check in found:
                print(check.line(), flush=True)
            checks.extend(found)
            if leftover := rig.leftover_processes(timeout=20):
                print(f"note: after {name}, still running on hosts {sorted(leftover)}; killed", flush=True)
                for host in leftover:
                    rig.kill_host_processes(host, ".")
    failed = [check.name for check in checks if not check.passed]
    print(f"eight hosts: {len(checks) - len(failed)} of {len(checks)} checks passed")
    if failed:
        raise BenchError(f"eight-hosts checks failed: {', '.join(failed)}")
    return checks
