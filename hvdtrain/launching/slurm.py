"""Slurm, as hvdtrain reads it: the allocation a run is inside (its nodes, tasks and CPUs, from the
variables Slurm gives every job), and how `srun` reports which MPI plugins it has.

Pure: everything here parses text or a mapping of variables it is given; nothing reads the machine.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping
from dataclasses import dataclass

from hvdtrain.launching.spec import HOST_NAME, LOOPBACK_NAMES, Host

RANGE = re.compile(r"(\d+)(?:-(\d+))?")
BRACKETS = re.compile(r"\[([^\[\]]*)\]")
TASK_COUNT = re.compile(r"(\d+)(?:\(x(\d+)\))?")
MAX_HOSTS = 100_000
"""A bound on what a host list may expand to: a typo such as h[1-999999999] is refused, not expanded."""


def _top_level_items(text: str, what: str) -> list[str]:
    """`text` split at the commas outside brackets."""
    items, depth, start = [], 0, 0
    for index, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            raise ValueError(f"{what} {text!r}: unbalanced brackets")
        if char == "," and depth == 0:
            items.append(text[start:index])
            start = index + 1
    if depth:
        raise ValueError(f"{what} {text!r}: unbalanced brackets")
    return [*items, text[start:]]


def _bracket_values(inside: str, text: str, what: str) -> list[str]:
    values = []
    for item in inside.split(","):
        match = RANGE.fullmatch(item)
        if not match:
            raise ValueError(f"{what} {text!r}: {item!r} in brackets is not N or N-M")
        low, high = match.group(1), match.group(2) or match.group(1)
        if int(high) < int(low):
            raise ValueError(f"{what} {text!r}: the range {item} runs backwards")
        if int(high) - int(low) >= MAX_HOSTS:
            raise ValueError(f"{what} {text!r}: the range {item} names more than {MAX_HOSTS} hosts")
        values += [str(number).zfill(len(low)) for number in range(int(low), int(high) + 1)]
    return values


def expand_hostlist(text: str, what: str = "SLURM_JOB_NODELIST") -> list[str]:
    """Slurm's compressed host list -> host names, in order: `h[1-2,4]` is h1, h2, h4; `n[01-02]`
    keeps the zeros; several bracket groups in a name are their product (`r[1-2]n[1-2]`); items are
    separated by commas outside brackets."""
    text = text.strip()
    if not text:
        raise ValueError(f"{what} is empty")
    hosts: list[str] = []
    for item in _top_level_items(text, what):
        if not item:
            raise ValueError(f"{what} {text!r}: an empty host name")
        pieces = BRACKETS.split(item)  # name, bracket, name, bracket, ..., name
        choices = [
            _bracket_values(piece, text, what) if index % 2 else [piece] for index, piece in enumerate(pieces)
        ]
        for parts in itertools.product(*choices):
            name = "".join(parts)
            if not HOST_NAME.match(name):
                raise ValueError(f"{what} {text!r}: {name!r} is not a host name")
            hosts.append(name)
            if len(hosts) > MAX_HOSTS:
                raise ValueError(f"{what} {text!r} names more than {MAX_HOSTS} hosts")
    return hosts


def expand_counts(text: str, what: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """Slurm's per-node counts -> one count per node: `2(x3),1` is 2, 2, 2, 1."""
    counts: list[int] = []
    for item in text.strip().split(","):
        match = TASK_COUNT.fullmatch(item.strip())
        if not match or int(match.group(1)) < 1 or (match.group(2) and int(match.group(2)) < 1):
            raise ValueError(f"{what} {text!r}: expected counts such as 2(x3),1")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


@dataclass(frozen=True)
class Allocation:
    """The Slurm job this process runs inside (salloc, sbatch, or a step of either)."""

    job_id: str
    nodes: tuple[str, ...]
    tasks_per_node: tuple[int, ...]
    cpus_per_task: int | None = None
    """--cpus-per-task where the job asked for it (each rank's threads), else None."""
    restart_count: int = 0
    """How often Slurm has requeued the job: above 0, a requeued job continues its run."""

    @property
    def tasks(self) -> int:
        return sum(self.tasks_per_node)

    def hosts(self) -> tuple[Host, ...]:
        return tuple(Host(node, tasks) for node, tasks in zip(self.nodes, self.tasks_per_node, strict=True))

    def describe(self) -> str:
        counts = sorted(set(self.tasks_per_node))
        per_node = (
            f"{counts[0]} task{'s' * (counts[0] > 1)} each"
            if len(counts) == 1
            else "tasks " + ",".join(map(str, self.tasks_per_node))
        )
        cpus = f", {self.cpus_per_task} CPUs per task" if self.cpus_per_task else ""
        return f"{len(self.nodes)} node{'s' * (len(self.nodes) > 1)} {','.join(self.nodes)}, {per_node}{cpus}"


def _positive(environ: Mapping[str, str], name: str) -> int | None:
    value = environ.get(name, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{name}={value!r}: expected a whole number of at least 1")
    return int(value)


def allocation_from(environ: Mapping[str, str]) -> Allocation | None:
    """The allocation Slurm's variables describe, None outside Slurm (no SLURM_JOB_ID); a variable
    Slurm would never write is a ValueError naming it."""
    job_id = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    if not job_id:
        return None
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if nodelist is None:
        raise ValueError(f"inside Slurm job {job_id}, but SLURM_JOB_NODELIST is not set")
    nodes = expand_hostlist(nodelist)
    if len(set(nodes)) != len(nodes):
        raise ValueError(f"SLURM_JOB_NODELIST {nodelist!r} names a node twice")
    tasks_text = environ.get("SLURM_TASKS_PER_NODE") or environ.get("SLURM_JOB_TASKS_PER_NODE")
    tasks = expand_counts(tasks_text) if tasks_text else [1] * len(nodes)
    if len(tasks) != len(nodes):
        step = " (inside a job step: run hvdtrain from the batch script or salloc's shell)"
        raise ValueError(
            f"SLURM_TASKS_PER_NODE {tasks_text!r} gives {len(tasks)} nodes' tasks for the "
            f"{len(nodes)} nodes of SLURM_JOB_NODELIST {nodelist!r}{step * ('SLURM_STEP_ID' in environ)}"
        )
    restarts = environ.get("SLURM_RESTART_COUNT", "0").strip() or "0"
    if not restarts.isdigit():
        raise ValueError(f"SLURM_RESTART_COUNT={restarts!r}: expected a whole number")
    return Allocation(
        job_id, tuple(nodes), tuple(tasks), _positive(environ, "SLURM_CPUS_PER_TASK"), int(restarts)
    )


def hosts_within(hosts: tuple[Host, ...], allocation: Allocation, this_node: str) -> None:
    """--hosts given inside an allocation: its nodes (this one by a loopback name too), at most the
    tasks the allocation gives each, or a ValueError naming the first that is not."""
    tasks = dict(zip(allocation.nodes, allocation.tasks_per_node, strict=True))
    for host in hosts:
        name = this_node if host.name in LOOPBACK_NAMES else host.name
        if name not in tasks:
            raise ValueError(
                f"--hosts: {host.name} is not a node of Slurm job {allocation.job_id} "
                f"({','.join(allocation.nodes)})"
            )
        if host.slots > tasks[name]:
            raise ValueError(
                f"--hosts: {host.name}:{host.slots} is more than the {tasks[name]} tasks Slurm job "
                f"{allocation.job_id} has on {name}"
            )


def mpi_plugins(srun_mpi_list: str) -> frozenset[str]:
    """The plugin names in what `srun --mpi=list` prints (`srun: pmix`, or `MPI plugin types are...`
    then one name a line, depending on the version)."""
    names = set()
    for line in srun_mpi_list.splitlines():
        word = line.removeprefix("srun:").strip()
        if re.fullmatch(r"[a-z0-9_]+", word) and word != "none":
            names.add(word)
    return frozenset(names)


def local_size(environ: Mapping[str, str]) -> int | None:
    """The tasks of this step on this node: SLURM_STEP_TASKS_PER_NODE's entry for SLURM_NODEID."""
    counts, node = environ.get("SLURM_STEP_TASKS_PER_NODE"), environ.get("SLURM_NODEID")
    if not counts or node is None or not node.isdigit():
        return None
    per_node = expand_counts(counts, "SLURM_STEP_TASKS_PER_NODE")
    return per_node[int(node)] if int(node) < len(per_node) else None


TASK_FAILED = re.compile(r"srun: error: \S+: tasks? \d+(?:[-,]\d+)*: Exited with exit code [1-9]")
"""srun saying a task of the step failed (the task id is a rank's under --launcher srun, a node's
under ddp, which runs one torchrun a node)."""

STATE_AT_END = {
    "finished": "COMPLETED",
    "failed": "FAILED",
    "interrupted": "CANCELLED",
    "diverged": "FAILED",
    "preempted": "REQUEUED",
}
"""The state Slurm gives a batch job whose `hvdtrain run` ended so: what run.json keeps once Slurm
has forgotten the job (the test rig, like many clusters, keeps no accounting to ask later)."""


def record_fields(allocation: Allocation, state: str = "RUNNING") -> dict[str, object]:
    """What run.json keeps of the Slurm job a run is in, apart from hvdtrain's own status."""
    return {
        "slurm_job_id": allocation.job_id,
        "slurm_state": state,
        "slurm_restart_count": allocation.restart_count,
    }


def state_from_squeue(text: str) -> str | None:
    """The job's state in `squeue -h -t all -j ID -o %T`'s answer (None: Slurm no longer knows it)."""
    words = [line.strip() for line in text.splitlines() if re.fullmatch(r"[A-Z_]+", line.strip())]
    return words[0] if words else None
