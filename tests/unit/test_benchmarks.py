"""The project's benchmark suite (benchmarks/, `make bench`), without running a benchmark."""

from __future__ import annotations


def test_start_up_overhead_runs_the_same_training_both_ways(tmp_path):
    from benchmarks import PROGRAMS, startup

    python = "/venv/bin/python"
    assert startup.hvdtrain_argv(python, tmp_path / "a") == [
        python, "-m", "hvdtrain", "run", "digits-mlp-torch", "--variant", "debug", "--np", "2",
        "--launcher", "gloo", "--run-dir", str(tmp_path / "a"),
    ]  # fmt: skip
    assert startup.horovodrun_argv(python, tmp_path / "b") == [
        "/venv/bin/horovodrun", "-np", "2", "--gloo", "--network-interface", "lo",
        "--output-filename", str(tmp_path / "b"), python, str(PROGRAMS / "handwritten_digits.py"),
    ]  # fmt: skip
    assert startup.raw_env({"PATH": "/bin"}, cores=8) == {"PATH": "/bin", "OMP_NUM_THREADS": "4"}
    assert startup.raw_env({}, cores=1)["OMP_NUM_THREADS"] == "1"


def test_start_up_overhead_line_shows_medians_and_their_difference():
    from benchmarks import startup

    line = startup.render([9.9, 9.0, 30.0], [8.5, 8.0, 9.0])
    assert "hvdtrain 9.90 s, raw horovodrun 8.50 s, difference +1.40 s  (goal <= 1.0 s)" in line
    assert "median of 3" in line


def test_the_bandwidth_table_has_fp32_and_fp16_rows_the_ceiling_and_the_gloo_ratios():
    from benchmarks.__main__ import render_bandwidth

    gloo = {
        (1, False): 0.5,
        (16, False): 1.8,
        (64, False): 1.9,
        (1, True): 0.4,
        (16, True): 2.5,
        (64, True): 2.7,
    }
    torch_gloo = {key: value / 1.2 for key, value in gloo.items()}
    lines = render_bandwidth({"horovod gloo": gloo, "torch.distributed gloo": torch_gloo}, 19.04).splitlines()
    assert lines[0].split()[-6:] == ["1", "MB", "16", "MB", "64", "MB"]
    assert lines[1].split()[-3:] == ["0.50", "1.80", "1.90"] and lines[1].startswith("horovod gloo fp32")
    assert lines[2].startswith("horovod gloo fp16") and lines[2].split()[-1] == "2.70"
    assert lines[5].split() == ["memcpy,", "one", "core", "(the", "ceiling)", "19.04"]
    assert lines[6:] == [
        "horovod gloo / torch gloo at 16 MB: 1.20  (goal >= 1.0)",
        "horovod gloo / torch gloo at 64 MB: 1.20  (goal >= 1.0)",
    ]


def test_goal_lines_compare_horovod_with_ddp_and_every_paths_scaling():
    from benchmarks.__main__ import goal_lines
    from hvdtrain.measure.bench import Row

    rows = [
        Row("synthetic-torch", "horovod", "gloo", 2, 700.0, 91.0, 0.88),
        Row("synthetic-torch", "horovod", "mpi", 2, 770.0, 83.0, 0.9),
        Row("synthetic-torch", "ddp", "-", 2, 680.0, 94.0, 0.8),
        Row("synthetic-torch", "ddp", "-", 1, 425.0, 75.0, 1.0),
    ]
    assert goal_lines(rows).splitlines() == [
        "horovod gloo / ddp samples/s at np=2: 1.03  (goal >= 1.0)",
        "horovod mpi / ddp samples/s at np=2: 1.13  (goal >= 1.1)",
        "weak scaling horovod gloo: 0.88  (goal >= 0.85)",
        "weak scaling horovod mpi: 0.90  (goal >= 0.85)",
        "weak scaling ddp: 0.80  (goal >= 0.85)",
    ]


def test_sections_are_chosen_by_name_and_an_unknown_one_is_refused(tmp_path, capsys):
    import pytest

    from benchmarks.__main__ import main, sections

    assert list(sections(tmp_path)) == [
        "handwritten", "peer", "workloads", "tuning", "startup", "weak-scaling", "scaling", "tune-link",
        "allreduce", "gloo-patches", "strategies", "elastic", "eight-hosts", "disk-data", "checkpoints",
        "memory", "sweeps", "chaos",
    ]  # fmt: skip
    with pytest.raises(SystemExit) as refused:
        main(["startup", "nope", "--out", str(tmp_path / "out")])
    assert refused.value.code == 2 and not (tmp_path / "out").exists()
    assert "unknown section nope; sections: handwritten, peer, workloads," in capsys.readouterr().err


def test_a_workload_table_prints_each_paths_rate_step_time_scaling_and_the_goal_ratios():
    from benchmarks.workloads import render

    rates = {"horovod gloo": 60.0, "horovod mpi": 66.0, "ddp": 55.0, "zero-1": 54.0, "zero-2": 48.0}
    rates |= {"fsdp": 40.0, "np=1": 35.0, "two np=1": 70.0, "horovod mpi bf16": 33.0, "ddp bf16": 66.0}
    lines = render("resnet-torch", rates).splitlines()
    assert lines[2].split() == ["horovod", "gloo", "60.0", "1067", "0.86", "0.86"]
    assert lines[-7:] == [
        "  horovod mpi / ddp: 1.20  (goal >= 1.1)",
        "  horovod gloo / ddp: 1.09  (goal >= 1.0)",
        "  zero-1 / horovod gloo: 0.90  (goal >= 0.95)",
        "  zero-2 / horovod gloo: 0.80  (goal >= 0.9)",
        "  horovod mpi in bf16: 33.0 samples/s, 0.50 of fp32",
        "  ddp in bf16: 66.0 samples/s, 1.20 of fp32",
        "  weak scaling against the ceiling, worst path: 0.57  (goal >= 0.9)",
    ]


def test_the_peer_is_horovods_own_benchmark_with_only_its_image_size_made_a_flag():
    """Undoing the two marked changes and dropping the header gives back Horovod 0.28.1's
    examples/pytorch/pytorch_synthetic_benchmark.py byte for byte (its sha256)."""
    import hashlib

    from benchmarks.workloads import PEER

    copied = PEER.read_text()
    header, _, body = copied.partition("import argparse\n")
    assert "Licensed under the Apache License, Version 2.0" in header and "v0.28.1" in header
    flag = (
        "parser.add_argument('--image-size', type=int, default=224,\n"
        "                    help='height and width of the images (changed by hvdtrain: 224 in Horovod)')\n"
    )
    assert body.count(flag) == 1
    original = (
        ("import argparse\n" + body).replace(flag, "").replace("args.image_size, args.image_size", "224, 224")
    )
    digest = hashlib.sha256(original.encode()).hexdigest()
    assert digest == "020759fa7293888607afa14c39be08aecac5ee9bd07ac63c4fc497b975d6ae88"


def test_the_peer_runs_under_plain_horovodrun_with_the_stand_in_torchvision_first_on_the_path():
    from benchmarks import PROGRAMS
    from benchmarks.workloads import PEER, peer_argv, peer_env

    assert peer_argv("/venv/bin/python") == [
        "/venv/bin/horovodrun", "-np", "2", "--gloo", "--network-interface", "lo", "/venv/bin/python",
        str(PEER), "--no-cuda", "--image-size", "64", "--batch-size", "32", "--num-batches-per-iter", "5",
        "--num-iters", "4",
    ]  # fmt: skip
    env = peer_env({"PYTHONPATH": "/mine", "PATH": "/bin"})
    assert env == {"PYTHONPATH": f"{PROGRAMS / 'peer'}:/mine", "PATH": "/bin", "OMP_NUM_THREADS": "1"}
    assert peer_env({})["PYTHONPATH"] == str(PROGRAMS / "peer")


def test_the_peers_rate_is_its_own_total_line_and_a_run_without_one_is_a_bench_error():
    import pytest

    from benchmarks.workloads import peer_samples_per_sec
    from hvdtrain.measure.bench import BenchError

    output = "[0]<stdout>:Img/sec per CPU: 35.7 +-0.2\n[0]<stdout>:Total img/sec on 2 CPU(s): 71.3 +-0.5\n"
    assert peer_samples_per_sec(output) == 71.3
    with pytest.raises(BenchError, match="printed no 'Total img/sec' line"):
        peer_samples_per_sec("[0]<stdout>:Running warmup...\n")


def test_the_stand_in_torchvision_builds_torchvisions_resnet_50_and_refuses_pretrained_weights():
    import subprocess
    import sys

    from benchmarks import PROGRAMS

    probe = (
        "from torchvision import models; m = models.resnet50(); "
        "print(sum(p.numel() for p in m.parameters()), type(m).__module__)\n"
        "try:\n    models.resnet50(weights='IMAGENET1K_V1')\nexcept ValueError as e:\n    print(e)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        env={"PYTHONPATH": str(PROGRAMS / "peer")},
        capture_output=True,
        text=True,
    )
    # torchvision's resnet50 has 25,557,032 parameters
    assert done.stdout.splitlines() == [
        "25557032 hvdtrain.models.resnet",
        "resnet50: pretrained weights cannot be had here; this torchvision is a stand-in",
    ], done.stderr


def test_the_chaos_runs_rollback_rule_allows_going_back_to_the_last_commit_and_no_further():
    from benchmarks.chaos import bad_restart, restarts

    steps = [7, 8, 9, 10, 11, 12, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 30, 31, 20]
    assert restarts(steps) == [(6, 12, 10), (16, 19, 30), (18, 31, 20)]
    assert not bad_restart(12, 10, 10)  # a rank failed in step 12: back to the commit at 10
    assert not bad_restart(10, 10, 10)  # failed in step 10, begun after the commit at 10
    assert not bad_restart(19, 30, 10)  # rank 0 killed before writing steps 20-29: a gap
    assert bad_restart(31, 20, 10)  # back past the commit at 30
    assert bad_restart(12, 11, 10) and bad_restart(19, 25, 10)  # not a commit


def test_the_chaos_runs_records_skip_what_a_resume_staged_on_each_host(tmp_path):
    from benchmarks.chaos import StepRecords

    class Rig:
        def private_disk(self, host):
            return tmp_path / f"host-{host}"

    files = [tmp_path / f"host-{host}" / "chaos" / "metrics.jsonl" for host in (1, 2)]
    files[0].parent.mkdir(parents=True)
    files[1].parent.mkdir(parents=True)
    lines = [f'{{"step": {step}, "lr": 0.1}}\n' for step in range(6)] + ['{"epoch": 1, "world_size": 2}\n']
    records = StepRecords(Rig(), "chaos", (1, 2))
    files[0].write_text("".join(lines[:3]) + '{"step": 3')  # a line half written
    records.poll()
    assert [step for _, step in records.steps] == [0, 1, 2]
    files[0].write_text("".join(lines[:4]))
    records.poll()
    assert [step for _, step in records.steps] == [0, 1, 2, 3]
    staged = "".join(lines[:5])
    records.resuming(staged.encode())
    files[1].write_text(staged[:20])  # the resume's copy, still being written
    records.poll()
    files[0].unlink()  # replaced whole, with more than was read from it
    files[0].write_text(staged)
    files[1].write_text(staged + lines[5] + lines[6])
    records.poll()
    assert [step for _, step in records.steps] == [0, 1, 2, 3, 5]
    assert [size for _, size in records.epochs] == [2] and not records.problems
