"""`hvdtrain submit`: a run as a Slurm batch job. The plan is pure (the batch script, where it goes,
the sbatch argv); `submit` writes the script into the run directory and hands it to sbatch.

The script `exec`s `hvdtrain run`, so the batch step's signals (scancel's SIGTERM, the warning of
--signal) reach hvdtrain itself, not a shell that would die of them. It asks Slurm to requeue the
job when it is preempted or its node fails (--requeue): `hvdtrain run` then sees
SLURM_RESTART_COUNT and resumes the run directory's run (hvdtrain.job.request.requeued).
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hvdtrain import strategies
from hvdtrain.job.request import RUNS, RunRequest, recipe_spec, script_file, script_name
from hvdtrain.options import COMMON
from hvdtrain.records.runs import now_iso
from hvdtrain.runtime.common import RUN_RECORD, atomic_write_bytes, read_json_object

SCRIPT = "submit.sbatch"
"""The batch script, in the run directory."""
OUTPUT = "slurm-%j.out"
"""The batch step's own output (hvdtrain's console), in the run directory; each rank's is in logs/."""
SLURM_TIME = re.compile(
    r"(?:\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d+|\d+-\d+:\d{1,2}|\d+-\d+:\d{1,2}:\d{1,2}|UNLIMITED|INFINITE)"
)
"""The forms sbatch --time takes: minutes, minutes:seconds, hours:minutes:seconds, days-hours,
days-hours:minutes, days-hours:minutes:seconds."""
NOT_IN_A_BATCH_JOB = {
    "hosts": "--hosts: a submitted job runs on the nodes Slurm allocates (--nodes)",
    "hostfile": "--hostfile: a submitted job runs on the nodes Slurm allocates (--nodes)",
    "image": "--image: a submitted job runs in the nodes' own environment",
}


ALLOCATION_KINDS = {"nodes": "int", "ntasks_per_node": "int", "time": "str", "partition": "str",
                    "sbatch_args": "strings"}  # fmt: skip
"""The Python API's keywords for a batch job's allocation, and their kinds (request.EXPECTED's)."""


@dataclass(frozen=True)
class SubmitRequest:
    """What `hvdtrain submit` was asked: the run, and the allocation to ask Slurm for."""

    run: RunRequest
    nodes: int = 1
    ntasks_per_node: int | None = None
    """None: --np spread over the nodes, else one task a node."""
    time: str | None = None
    partition: str | None = None
    sbatch_args: tuple[str, ...] = ()
    """More sbatch options, each as one argument (`--gres=gpu:4`), written into the script."""


@dataclass(frozen=True)
class SubmitPlan:
    script: str
    run_dir: Path
    """Absolute: the batch job runs in the submitting directory, and finds the run there."""
    argv: list[str]
    recipe: str

    @property
    def script_path(self) -> Path:
        return self.run_dir / SCRIPT


def _flag(option: Any, value: Any) -> list[str]:
    if option.type is bool:
        return [option.flag] if value else []
    return [option.flag, str(value)]


def run_argv(request: RunRequest) -> list[str]:
    """The `hvdtrain run` arguments that ask for `request` again (its target, options and script
    arguments); what the CLI would parse back into the same request: each option of the command
    line whose value is not its default."""
    argv = [request.target]
    for option in COMMON:
        value = getattr(request, option.name)
        if option.flag is None or value == option.default:
            continue
        if option.kind == "bool":
            argv.append(option.flag)
        elif option.kind in ("strings", "overrides"):
            argv += [part for item in value for part in (option.flag, item)]
        else:
            argv += [option.flag, str(value)]
    every = strategies.all_options()
    for name, value in sorted(request.strategy_options.items()):
        if value is not None:
            argv += _flag(every[name][0], value)
    if request.script_args:
        argv += ["--", *request.script_args]
    return argv


def plan_submit(
    request: SubmitRequest, *, python: str, cwd: Path, timestamp: str, sbatch: bool, name: str | None = None
) -> SubmitPlan:
    """Pure: the batch script and the sbatch argv, or a ValueError naming what is wrong. `name`: the
    recipe's (a run directory's default name begins with it), else the script's."""
    run = request.run
    for option, why in NOT_IN_A_BATCH_JOB.items():
        if getattr(run, option):
            raise ValueError(why)
    if run.max_restarts < 0:
        raise ValueError(f"--max-restarts must be 0 or more, got {run.max_restarts}")
    if run.resume and run.run_dir is None:
        raise ValueError("--resume in a batch job needs --run-dir: the run to continue")
    name = name or Path(run.target).stem
    run_dir = cwd / (run.run_dir or RUNS / f"{name}-{timestamp}")
    header = batch_header(
        request, sbatch=sbatch, cwd=cwd, where=run_dir, name=name, what=f"the run {run_dir.name}"
    )
    command = [python, "-m", "hvdtrain", "run", *run_argv(replace(run, run_dir=run_dir))]
    return SubmitPlan(
        batch_script(header, command), run_dir, ["sbatch", "--parsable", str(run_dir / SCRIPT)], name
    )


def batch_header(
    request: SubmitRequest, *, sbatch: bool, cwd: Path, where: Path, name: str, what: str
) -> list[str]:
    """Pure: the #SBATCH lines of a job of `request`'s allocation whose output goes into `where`, or a
    ValueError naming what is wrong. The job asks to be requeued when preempted."""
    run = request.run
    if not sbatch:
        raise ValueError("hvdtrain submit needs Slurm's sbatch on PATH (is this a Slurm login node?)")
    if request.nodes < 1:
        raise ValueError(f"--nodes must be at least 1, got {request.nodes}")
    if run.np is not None and run.np < 1:
        raise ValueError(f"--np must be at least 1, got {run.np}")
    if request.nodes > 1 and not strategies.spans_hosts(run.strategy):
        raise ValueError(f"--strategy {run.strategy} runs on one node of a Slurm job; give --nodes 1")
    per_node = request.ntasks_per_node
    if per_node is None:
        per_node = -(-run.np // request.nodes) if run.np else 1
    if per_node < 1:
        raise ValueError(f"--ntasks-per-node must be at least 1, got {per_node}")
    if run.np is not None and run.np > request.nodes * per_node:
        raise ValueError(
            f"--np {run.np} is more than the {request.nodes * per_node} tasks of --nodes {request.nodes} "
            f"x --ntasks-per-node {per_node}"
        )
    if request.time is not None and not SLURM_TIME.fullmatch(request.time):
        raise ValueError(
            f"--time {request.time!r}: Slurm takes MINUTES, MINUTES:SECONDS, HOURS:MINUTES:SECONDS, "
            "DAYS-HOURS, DAYS-HOURS:MINUTES or DAYS-HOURS:MINUTES:SECONDS"
        )
    for argument in request.sbatch_args:
        if not argument.startswith("-") or "\n" in argument:
            raise ValueError(f"--sbatch-arg {argument!r}: give one sbatch option, such as --gres=gpu:4")
    for place in (cwd, where):  # #SBATCH lines are not quoted, and sbatch expands % in --output
        if any(char.isspace() or char == "%" for char in str(place)):
            raise ValueError(f"{place}: a Slurm batch job needs a path without spaces or %")
    return [
        "#!/bin/bash",
        f"# Written by hvdtrain submit: {what}, as a Slurm batch job.",
        f"#SBATCH --job-name=hvdtrain-{re.sub(r'[^A-Za-z0-9_.-]+', '-', name)}",
        f"#SBATCH --nodes={request.nodes}",
        f"#SBATCH --ntasks-per-node={per_node}",
        *([f"#SBATCH --time={request.time}"] if request.time else []),
        *([f"#SBATCH --partition={request.partition}"] if request.partition else []),
        f"#SBATCH --chdir={cwd}",
        f"#SBATCH --output={where / OUTPUT}",
        "#SBATCH --open-mode=append",
        "#SBATCH --requeue",
        *(f"#SBATCH {argument}" for argument in request.sbatch_args),
    ]


def batch_script(header: list[str], command: list[str]) -> str:
    return "\n".join(
        [
            *header,
            "",
            "# exec: hvdtrain itself gets the batch step's signals.",
            "exec " + shlex.join(command),
            "",
        ]
    )


@dataclass(frozen=True)
class Submission:
    """A job sbatch took: its id, and where its run and batch script are."""

    job_id: str
    run_dir: Path
    script: Path


def submit(plan: SubmitPlan, environ: Mapping[str, str] | None = None) -> Submission:
    """Writes the script into the run directory and submits it (sbatch). run.json then says
    `submitted`, with the job's id and state apart from hvdtrain's own status."""
    job_id = sbatch(plan, environ)
    record = {"recipe": plan.recipe, "status": "submitted", "submitted": now_iso()}
    record |= {"slurm_job_id": job_id, "slurm_state": "PENDING", "slurm_restart_count": 0}
    previous = read_json_object(plan.run_dir / RUN_RECORD) or {}
    if previous.get("status") not in (None, "submitted"):  # a run submitted again to resume keeps its record
        record = {**previous, **{key: value for key, value in record.items() if key.startswith("slurm_")}}
    atomic_write_bytes(plan.run_dir / RUN_RECORD, (json.dumps(record) + "\n").encode())
    return Submission(job_id, plan.run_dir, plan.script_path)


def sbatch(plan: SubmitPlan, environ: Mapping[str, str] | None = None) -> str:
    """Writes the script into its directory and hands it to sbatch; the job's id. sbatch's refusal is
    a ValueError with its own message, and a directory made for it is removed again."""
    existed = plan.run_dir.exists()
    try:
        plan.run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(plan.script_path, plan.script.encode())
    except OSError as error:
        raise ValueError(f"cannot write the run directory {plan.run_dir}: {error.strerror}") from None
    try:
        done = subprocess.run(
            plan.argv,
            capture_output=True,
            text=True,
            timeout=60,
            env=None if environ is None else dict(environ),
        )
        said = [line for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        problem = None if done.returncode == 0 else (said[-1] if said else f"exit code {done.returncode}")
    except (OSError, subprocess.TimeoutExpired) as error:
        problem = f"sbatch did not answer: {error}"
    if problem is not None:
        if not existed:
            plan.script_path.unlink(missing_ok=True)
            plan.run_dir.rmdir()
        raise ValueError(f"sbatch refused the job: {re.sub(r'^sbatch: (error|fatal): ', '', problem)}")
    return done.stdout.strip().splitlines()[-1].partition(";")[0]  # --parsable: ID[;CLUSTER]


def check_run(run: RunRequest) -> str:
    """What the job's `hvdtrain run` would refuse whichever nodes it gets, refused now: an unknown
    recipe, strategy or option, a bad --set or --variant. (np, hosts and cores are the allocation's,
    known only inside it.) Returns the name a run directory takes by default: the recipe's, else
    the script's."""
    recipe, _ = checked_recipe(run)
    return recipe.name if recipe is not None else script_name(run.target, run.module)


def checked_recipe(run: RunRequest) -> tuple[Any, Any]:
    """check_run's checks; the recipe (None for a script) and its config with --variant and --set
    (None for a script, or a resume, whose config is its checkpoint's)."""
    from hvdtrain import config as config_module
    from hvdtrain import registry, strategies

    found = script_file(run.target, run.module, Path.cwd())
    if found is None and (run.module or registry.is_path(run.target)):
        raise ValueError(f"{'module ' if run.module else ''}{run.target} not found")
    script_text = None if found is None else found.read_text(errors="replace")
    spec = recipe_spec(run.target, script_text, Path.cwd(), run.module)  # as `hvdtrain run` reads TARGET
    recipe = registry.load(spec) if spec is not None else None
    framework = recipe.framework if recipe else "torch"
    strategy = strategies.get(run.strategy, framework)
    strategies.resolve_options(strategy, run.strategy_options)
    config = None
    if recipe is not None and not run.resume:
        overrides = config_module.parse_overrides(recipe.config, run.overrides)
        config = config_module.apply(recipe.make_config(run.variant), overrides)
        if reason := strategy.refuse(config):
            raise ValueError(reason)
    return recipe, config


def prepare(request: SubmitRequest) -> SubmitPlan:
    """The plan of a submission, from this machine's facts; nothing written."""
    import shutil
    import sys
    import time

    name = check_run(request.run)
    return plan_submit(
        request,
        python=sys.executable,
        cwd=Path.cwd(),
        timestamp=time.strftime("%Y%m%d-%H%M%S"),
        sbatch=shutil.which("sbatch") is not None,
        name=name,
    )
