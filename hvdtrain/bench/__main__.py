"""`make bench`: the project's benchmark suite, every comparison measured side by side in one run."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

from hvdtrain.bench import (
    PROGRAMS,
    BenchError,
    elastic,
    hvdtrain_run,
    matrix,
    plot,
    recipe_samples_per_sec,
    record_launchers,
    render,
    script_samples_per_sec,
    write_csv,
)
from hvdtrain.launch import rank_json_records

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
    rates = {np_: [] for np_ in (1, 2)}
    for repeat in range(REPEATS):
        for np_ in rates:
            rates[np_].append(
                recipe_samples_per_sec(
                    "synthetic-torch",
                    "horovod",
                    np_,
                    "gloo",
                    STEPS,
                    EPOCHS,
                    out / f"scaling-np{np_}-{repeat}",
                    ("--threads-per-rank", "1"),
                )
            )
    one, two = statistics.median(rates[1]), statistics.median(rates[2])
    print(
        f"synthetic-torch, 1 thread per rank: np=1 {one:.1f} samples/s, np=2 {two:.1f} samples/s, "
        f"weak-scaling efficiency {two / (2 * one):.3f}  (goal >= 0.85)"
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
    sizes = sorted({size for lines in results.values() for size in lines})
    print(f"{'allreduce bus GB/s (np=2)':<26}" + "".join(f"{f'{mb} MB':>10}" for mb in sizes))
    for name, lines in results.items():
        print(f"{name:<26}" + "".join(f"{lines.get(mb, float('nan')):>10.2f}" for mb in sizes))


def _bandwidth_lines(run_dir: Path) -> dict[int, float]:
    found = {
        r["megabytes"]: r["bus_gb_per_s"] for r in rank_json_records(run_dir / "logs") if "bus_gb_per_s" in r
    }
    if not found:
        raise BenchError(f"no bandwidth lines in {run_dir}")
    return found


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
    write_csv(rows, out / "bench.csv")
    plot(rows, out / "bench.png")
    record_launchers(rows, "torch")


def main() -> int:
    out = Path("runs") / f"bench-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    print(f"hvdtrain benchmarks, {time.strftime('%Y-%m-%d %H:%M')}, results in {out}", flush=True)
    sections = [
        (
            "hvdtrain vs a hand-written Horovod loop (np=2, gloo)",
            lambda: (
                versus_handwritten("synthetic-torch", "handwritten_torch.py", out),
                versus_handwritten("synthetic-tf", "handwritten_tf.py", out),
            ),
        ),
        ("weak scaling", lambda: weak_scaling(out)),
        ("allreduce bus bandwidth", lambda: allreduce_bandwidth(out)),
        (
            "strategies and launchers: synthetic-torch, batch 32 per process, 1 thread each",
            lambda: strategies_table(out),
        ),
        (
            "elastic recovery: digits-mlp-torch on two namespace hosts (hvdtrain.rig), --stall-timeout 10",
            elastic.main,
        ),
    ]
    for title, section in sections:
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
