"""`make bench` (`python -m benchmarks`): the project's benchmark suite, every comparison measured side
by side in one run; results go to runs/bench-TIMESTAMP."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks import (
    PROGRAMS,
    chaos,
    checkpoints,
    disk_data,
    eight_hosts,
    elastic,
    memory,
    scaling,
    script_samples_per_sec,
    startup,
    sweeps,
    tune_link,
    workloads,
)
from hvdtrain.launching.rank_output import rank_json_records
from hvdtrain.measure.bench import (
    BenchError,
    hvdtrain_run,
    matrix,
    plot,
    recipe_samples_per_sec,
    record_launchers,
    render,
    write_csv,
)

REPEATS = 3
EPOCHS, STEPS = 4, 20


def versus_handwritten(recipe: str, script: str, out: Path) -> None:
    ours, theirs = [], []
    for repeat in range(REPEATS):  # interleaved, so drift on a shared machine hits both alike
        ours.append(
            recipe_samples_per_sec(recipe, "horovod", 2, "gloo", STEPS, EPOCHS, out / f"{recipe}-{repeat}")
        )
        theirs.append(
            script_samples_per_sec(
                PROGRAMS / script,
                2,
                "gloo",
                out / f"{script}-{repeat}",
                "--epochs",
                str(EPOCHS),
                "--steps",
                str(STEPS),
            )
        )
    ratio = statistics.median(ours) / statistics.median(theirs)
    print(
        f"{recipe:<16} hvdtrain {statistics.median(ours):8.1f} samples/s   hand-written Horovod "
        f"{statistics.median(theirs):8.1f} samples/s   ratio {ratio:.3f}  (goal >= 0.98)"
    )


def weak_scaling(out: Path) -> None:
    """np=2 against twice np=1, and the ceiling without any communication: two independent np=1
    runs at the same time (what sharing the machine's cores and memory alone costs)."""

    def rate(np_: int, run_dir: Path) -> float:
        args = ("--threads-per-rank", "1")
        return recipe_samples_per_sec("synthetic-torch", "horovod", np_, "gloo", STEPS, EPOCHS, run_dir, args)

    rates: dict[str, list[float]] = {"np1": [], "np2": [], "two np1": []}
    for repeat in range(REPEATS):
        rates["np1"].append(rate(1, out / f"scaling-np1-{repeat}"))
        rates["np2"].append(rate(2, out / f"scaling-np2-{repeat}"))
        with ThreadPoolExecutor(2) as pool:
            rates["two np1"].append(
                sum(pool.map(rate, (1, 1), [out / f"scaling-apart{i}-{repeat}" for i in (0, 1)]))
            )
    one, two, apart = (statistics.median(rates[name]) for name in ("np1", "np2", "two np1"))
    print(
        f"synthetic-torch, 1 thread per rank: np=1 {one:.1f} samples/s, np=2 {two:.1f} samples/s, "
        f"weak-scaling efficiency {two / (2 * one):.3f}  (goal >= 0.85)"
    )
    print(
        f"two independent np=1 runs at once: {apart:.1f} samples/s together, {apart / (2 * one):.3f} "
        "(the ceiling without communication)"
    )


def memcpy_gb_per_s(megabytes: int = 64, repeats: int = 10) -> float:
    """One core copying memory (the ceiling of any allreduce on this machine): the best of `repeats`."""
    import numpy as np

    source = np.ones(megabytes * 2**20 // 8)
    target = np.empty_like(source)
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        np.copyto(target, source)
        best = min(best, time.perf_counter() - began)
    return source.nbytes / best / 1e9


GLOO_PATCH_VARIABLES = ("HOROVOD_IDLE_WAIT_MS", "HOROVOD_GLOO_BUSY_PAIR_PAUSE_US")


def gloo_patches(out: Path) -> None:
    """Patches 0014 and 0015 side by side, each switched off by its variable (0 restores Horovod's
    and gloo's own behaviour): the Gloo controller coordinating every cycle against sleeping while a
    rank has no tensor in flight, then gloo's event loop spinning on a pair its sender holds against
    pausing; DDP as the yardstick; interleaved."""
    runs = {
        "as released": ("horovod", "gloo", {name: "0" for name in GLOO_PATCH_VARIABLES}),
        "0014": ("horovod", "gloo", {"HOROVOD_GLOO_BUSY_PAIR_PAUSE_US": "0"}),
        "0014+0015": ("horovod", "gloo", {}),
        "ddp": ("ddp", None, {}),
    }
    rates: dict[str, list[float]] = {name: [] for name in runs}
    base = {name: value for name, value in os.environ.items() if name not in GLOO_PATCH_VARIABLES}
    for repeat in range(REPEATS):
        for name, (strategy, launcher, switched_off) in runs.items():
            run_dir = out / f"gloo-patches-{name.replace('+', '-')}-{repeat}"
            env = {**base, **switched_off}
            rates[name].append(
                recipe_samples_per_sec(
                    "synthetic-torch", strategy, 2, launcher, STEPS, EPOCHS, run_dir, env=env
                )
            )
    median = {name: statistics.median(found) for name, found in rates.items()}
    print(
        "synthetic-torch np=2, horovod gloo samples/s: "
        + ", ".join(f"{name} {median[name]:.1f}" for name in runs if name != "ddp")
        + f"; ddp {median['ddp']:.1f}"
    )
    released, patched, ddp = median["as released"], median["0014+0015"], median["ddp"]
    print(
        f"0014 (sleeps while idle) / as released {median['0014'] / released:.2f}; "
        f"0015 (loop pauses on a busy pair) / 0014 alone {patched / median['0014']:.2f}; "
        f"against ddp: {released / ddp:.2f} -> {patched / ddp:.2f}  (goal >= 1.0)"
    )


def allreduce_bandwidth(out: Path) -> None:
    runs = {
        "horovod gloo": ("--launcher", "gloo"),
        "horovod mpi": ("--launcher", "mpi"),
        "torch.distributed gloo": ("--strategy", "ddp"),
    }
    results = {}
    for name, args in runs.items():
        run_dir = hvdtrain_run(
            str(PROGRAMS / "allreduce.py"),
            "--np",
            "2",
            *args,
            run_dir=out / name.replace(" ", "-"),
            script_args=("--backend", "torch" if "torch" in name else "horovod"),
        )
        results[name] = _bandwidth_lines(run_dir)
    print(render_bandwidth(results, memcpy_gb_per_s()))


def render_bandwidth(results: dict[str, dict[tuple[int, bool], float]], memcpy: float) -> str:
    """The bus GB/s table (fp32 and fp16 rows per path), the memcpy ceiling and the gloo goal ratios."""
    sizes = sorted({size for lines in results.values() for size, _ in lines})
    lines = [f"{'allreduce bus GB/s (np=2)':<34}" + "".join(f"{f'{mb} MB':>9}" for mb in sizes)]
    for name, measured in results.items():
        for fp16 in (False, True):
            label = f"{name} {'fp16' if fp16 else 'fp32'}"
            lines.append(
                f"{label:<34}" + "".join(f"{measured.get((mb, fp16), float('nan')):>9.2f}" for mb in sizes)
            )
    lines.append(f"{'memcpy, one core (the ceiling)':<34}{memcpy:>9.2f}")
    hvd, torch_gloo = results.get("horovod gloo", {}), results.get("torch.distributed gloo", {})
    for mb in (16, 64):
        if (mb, False) in hvd and (mb, False) in torch_gloo:
            ratio = hvd[(mb, False)] / torch_gloo[(mb, False)]
            lines.append(f"horovod gloo / torch gloo at {mb} MB: {ratio:.2f}  (goal >= 1.0)")
    return "\n".join(lines)


def _bandwidth_lines(run_dir: Path) -> dict[tuple[int, bool], float]:
    found = {
        (r["megabytes"], bool(r.get("fp16"))): r["bus_gb_per_s"]
        for r in rank_json_records(run_dir / "logs")
        if "bus_gb_per_s" in r
    }
    if not found:
        raise BenchError(f"no bandwidth lines in {run_dir}")
    return found


def goal_lines(rows) -> str:
    """The throughput goals read off one strategies table: Horovod over each launcher against DDP at np=2,
    and every path's weak scaling (np=2 against twice np=1)."""
    at = {(row.strategy, row.launcher, row.np): row for row in rows}
    lines = []
    ddp = at.get(("ddp", "-", 2))
    for launcher, goal in (("gloo", 1.0), ("mpi", 1.1)):
        if ddp and (horovod := at.get(("horovod", launcher, 2))):
            ratio = horovod.samples_per_sec / ddp.samples_per_sec
            lines.append(f"horovod {launcher} / ddp samples/s at np=2: {ratio:.2f}  (goal >= {goal})")
    for (strategy, launcher, np_), row in at.items():
        if np_ == 2 and row.scaling_efficiency is not None:
            path = strategy if launcher == "-" else f"{strategy} {launcher}"
            lines.append(f"weak scaling {path}: {row.scaling_efficiency:.2f}  (goal >= 0.85)")
    return "\n".join(lines)


def strategies_table(out: Path) -> None:
    rows = matrix(
        "synthetic-torch",
        ["horovod", "ddp"],
        [1, 2],
        ["gloo", "mpi"],
        STEPS,
        EPOCHS,
        32,
        out / "strategies",
        repeats=2,
    )
    print(render(rows))
    print(goal_lines(rows))
    write_csv(rows, out / "bench.csv")
    plot(rows, out / "bench.png")
    record_launchers(rows, "torch")


def sections(
    out: Path, chaos_minutes: float | None = None, chaos_seed: int | None = None
) -> dict[str, tuple[str, Callable[[], object]]]:
    """name -> (title, run), in the order `make bench` runs them."""
    return {
        "handwritten": (
            "hvdtrain vs a hand-written Horovod loop (np=2, gloo)",
            lambda: (
                versus_handwritten("synthetic-torch", "handwritten_torch.py", out),
                versus_handwritten("synthetic-tf", "handwritten_tf.py", out),
            ),
        ),
        "peer": (
            "hvdtrain vs Horovod's synthetic ResNet benchmark (ResNet-50, 64x64, batch 32, np=2, gloo)",
            lambda: workloads.versus_horovod_benchmark(out),
        ),
        "workloads": (
            "the models users train at np=2, every path, one core a rank (3 epochs of 5 steps, the "
            "first left out; interleaved twice); bf16 against fp32 for horovod mpi and ddp",
            lambda: workloads.main(out),
        ),
        "tuning": (
            "Horovod's fusion threshold and cycle time (its defaults, four other settings, its autotune; "
            "over mpi) and DDP's bucket size (its default, three others): np=2, one core a rank, 3 "
            "epochs of 5 steps, the first left out",
            lambda: workloads.tuning(out),
        ),
        "startup": (
            "start-up overhead: hvdtrain run vs a plain horovodrun of the same training (np=2, gloo)",
            lambda: startup.main(out, REPEATS),
        ),
        "weak-scaling": ("weak scaling", lambda: weak_scaling(out)),
        "scaling": (
            "the scaling curve on shaped links: 1..8 ranks one a namespace host, every link held to a rate "
            "(root only; narrowed by SCALING_RECIPES, SCALING_RANKS, SCALING_RATES, SCALING_PATHS)",
            lambda: scaling.main(out / "scaling"),
        ),
        "tune-link": (
            "bench --tune learning the link: gpt-torch at np=2 across two namespace hosts at 100 Mbit/s "
            "and unshaped, what --tune keeps at each (root only)",
            lambda: tune_link.main(out / "tune-link"),
        ),
        "allreduce": ("allreduce bus bandwidth", lambda: allreduce_bandwidth(out)),
        "gloo-patches": (
            "Horovod's gloo path with and without patches 0014 (idle wait) and 0015 (busy-pair pause)",
            lambda: gloo_patches(out),
        ),
        "strategies": (
            "strategies and launchers: synthetic-torch, batch 32 per process, 1 thread each",
            lambda: strategies_table(out),
        ),
        "elastic": (
            "elastic recovery: digits-mlp-torch on two namespace hosts (tests/support/rig.py), "
            "--stall-timeout 10",
            elastic.main,
        ),
        "eight-hosts": (
            "eight namespace hosts, tiny models: horovod gloo, MPI and ddp at 8 x 1 with the same weights; "
            "hierarchical allreduce at 4 x 2; Slurm on 8 nodes; elastic 8 -> 6 -> 8 (root only; "
            "EIGHT_HOSTS_CHECKS picks some)",
            lambda: eight_hosts.main(out / "eight-hosts"),
        ),
        "disk-data": (
            "data from disk: a loader core on files and on tar shards; rank memory as files and shards grow",
            lambda: disk_data.main(out),
        ),
        "checkpoints": (
            "checkpoints: training time lost per checkpoint, written as the step waits and in the "
            "background (async_checkpoint); gpt-torch and resnet-torch, one rank on one core, the other free",
            lambda: checkpoints.main(out),
        ),
        "memory": (
            "memory per rank: gpt-torch at 57M parameters with AdamW, horovod, zero-1, zero-2 and fsdp",
            lambda: memory.main(out),
        ),
        "sweeps": (
            f"hvdtrain sweep: {sweeps.RECIPE} over lr and width at np=2, {sweeps.TRIALS} trials, seed "
            f"{sweeps.SEED}: no pruning against --pruner {sweeps.PRUNED}",
            lambda: sweeps.main(out),
        ),
        "chaos": (
            f"chaos run: an elastic digits-mlp-torch job on four namespace hosts for "
            f"{chaos.minutes_wanted(chaos_minutes):g} min of seeded random faults (kill -9, SIGSTOP, link "
            "down, sshd stopped, SIGTERM and --resume)",
            lambda: chaos.main(out / "chaos", chaos_minutes, chaos_seed),
        ),
    }


def main(argv: list[str] | None = None) -> int:
    names = list(sections(Path()))
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="hvdtrain's benchmark suite (make bench), every comparison measured side by side.",
    )
    parser.add_argument(
        "sections", nargs="*", metavar="SECTION", help=f"of: {', '.join(names)} [default: all, in this order]"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="results folder [default: runs/bench-TIMESTAMP]"
    )
    parser.add_argument(
        "--chaos-minutes",
        type=float,
        default=None,
        help=f"minutes of chaos [default: ${chaos.MINUTES_ENV}, else {chaos.MINUTES:g}]",
    )
    parser.add_argument(
        "--chaos-seed",
        type=int,
        default=None,
        help=f"the chaos section's schedule [default: ${chaos.SEED_ENV}, else {chaos.SEED}]",
    )
    args = parser.parse_args(argv)
    if unknown := [name for name in args.sections if name not in names]:
        parser.error(f"unknown section {', '.join(unknown)}; sections: {', '.join(names)}")
    out = args.out or Path("runs") / f"bench-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    print(f"hvdtrain benchmarks, {time.strftime('%Y-%m-%d %H:%M')}, results in {out}", flush=True)
    chosen = sections(out, args.chaos_minutes, args.chaos_seed)
    for name in args.sections or names:
        title, section = chosen[name]
        print(f"\n== {title}", flush=True)
        try:
            section()
        except (BenchError, RuntimeError) as error:
            print(f"hvdtrain: benchmark failed: {error}", file=sys.stderr)
            return 1
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
