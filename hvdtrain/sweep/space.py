"""What a sweep searches and how it asks for each trial, decided before anything runs: pure functions,
no Optuna, nothing read but the recipe's config class.

A search space is typed ranges over the recipe's own config fields (`--param NAME=SPEC`):

    log:A:B       a float field (or an int field) sampled log-uniformly in [A, B], A > 0
    float:A:B     a float field, uniformly in [A, B]
    int:A:B       an int field, uniformly among A..B
    choice:X,Y,Z  any field --set can set, one of the values (read as --set reads them)

Every value a range can give is checked against the field's type and bounds, and the whole config
at each end of each range against the config's own checks (`hvdtrain.config.validate`), so a sweep
that would fail on its fifth trial is refused before the first.
"""

from __future__ import annotations

import dataclasses
import math
import re
import shlex
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from hvdtrain import config as config_module
from hvdtrain.config import TrainConfig
from hvdtrain.runtime import metrics as metrics_module

KINDS = ("log", "float", "int", "choice")
SAMPLERS = ("tpe", "random", "grid")
PRUNERS = ("median", "halving", "hyperband", "none")
DIRECTIONS = ("maximize", "minimize")
GRID_MOST = 10_000
"""The most points a grid may have (int ranges are enumerated)."""
TRIAL_DIR = "trial-{number:03d}"
"""A trial's run directory under the sweep's."""
SWEEP_RECORD = "sweep.json"
JOURNAL = "study.journal"
"""The Optuna JournalStorage file in the sweep directory (no server; fine on a shared disk)."""
SWEEP_STAMP = re.compile(r"^sweep-(.+)-(\d{8}-\d{6})$")


@dataclass(frozen=True)
class Param:
    """One searched field: its kind and range (low..high) or its choices, typed as the field is."""

    name: str
    kind: str
    """log, float, int or choice."""
    low: float | int | None = None
    high: float | int | None = None
    choices: tuple[Any, ...] = ()
    integer: bool = False
    """log over an int field: sampled as ints."""
    spec: str = ""
    """As given: NAME=KIND:..., for messages and for the sweep's record."""

    def ends(self) -> tuple[Any, ...]:
        """The values that bound what this param can give: a range's two ends, or every choice."""
        return self.choices if self.kind == "choice" else (self.low, self.high)

    def grid_values(self) -> tuple[Any, ...]:
        if self.kind == "choice":
            return self.choices
        if self.kind == "int" or self.integer:
            return tuple(range(int(self.low), int(self.high) + 1))
        raise ValueError(
            f"--param {self.spec}: --sampler grid needs choice: or int: params (a {self.kind} range "
            "has no grid); give its values as choice:A,B,C"
        )


def parse_param(text: str) -> Param:
    """NAME=KIND:..., read for its syntax only (check_params types it against the recipe)."""
    name, sep, spec = text.partition("=")
    name = name.strip().replace("-", "_")
    if not sep or not name or not spec:
        raise ValueError(f"--param {text!r}: expected NAME=KIND:..., e.g. lr=log:1e-4:1e-1")
    kind, _, rest = spec.partition(":")
    kind = kind.strip()
    if kind not in KINDS:
        raise ValueError(
            f"--param {text}: unknown kind {kind!r}; kinds: log:A:B, float:A:B, int:A:B, choice:X,Y"
        )
    if kind == "choice":
        choices = tuple(item.strip() for item in rest.split(","))
        if not rest.strip() or not all(choices):
            raise ValueError(f"--param {text}: expected choice:X,Y,... with no empty value")
        if len(set(choices)) != len(choices):
            raise ValueError(f"--param {text}: a choice is given twice")
        return Param(name, kind, choices=choices, spec=f"{name}={spec}")
    parts = rest.split(":")
    if len(parts) != 2 or not all(part.strip() for part in parts):
        raise ValueError(f"--param {text}: expected {kind}:LOW:HIGH")
    try:
        low, high = (int(p) if kind == "int" else float(p) for p in parts)
    except ValueError:
        number = "integers" if kind == "int" else "numbers"
        raise ValueError(f"--param {text}: LOW and HIGH must be {number}") from None
    if not all(math.isfinite(value) for value in (low, high)):
        raise ValueError(f"--param {text}: LOW and HIGH must be finite")
    if not low < high:
        raise ValueError(f"--param {text}: LOW must be below HIGH")
    if kind == "log" and low <= 0:
        raise ValueError(f"--param {text}: a log range needs LOW > 0")
    return Param(name, kind, low, high, spec=f"{name}={spec}")


def _field_type(annotation: Any) -> Any:
    """A field's type without its None (clip_grad_norm: float | None is a float field)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        return members[0] if len(members) == 1 else annotation
    return annotation


def _type_word(kind: Any) -> str:
    if typing.get_origin(kind) is Literal:
        return "choice of " + ", ".join(map(str, typing.get_args(kind)))
    return getattr(kind, "__name__", str(kind))


def typed_param(param: Param, config_class: type[TrainConfig]) -> Param:
    """The param with values of its field's type; a ValueError where the field does not exist, or
    its type does not take this kind of range."""
    known = config_module.fields_of(config_class)
    if param.name not in known:
        raise ValueError(
            f"--param {param.spec}: the recipe has no field {param.name}; fields: {', '.join(sorted(known))}"
        )
    annotation = typing.get_type_hints(config_class)[param.name]
    kind = _field_type(annotation)
    if param.kind == "choice":
        values = []
        for raw in param.choices:
            try:
                values.append(config_module._coerce(param.name, annotation, raw))
            except ValueError as error:
                why = str(error).split(": ", 1)[-1]
                raise ValueError(f"--param {param.spec}: {raw!r}: {why}") from None
        return replace(param, choices=tuple(values))
    if kind is bool or kind not in (int, float):
        raise ValueError(
            f"--param {param.spec}: {param.name} is a {_type_word(kind)} field; give its values as choice:X,Y"
        )
    if param.kind == "float" and kind is int:
        raise ValueError(f"--param {param.spec}: {param.name} is an int field; use int:A:B or log:A:B")
    if param.kind == "int" and kind is float:
        raise ValueError(f"--param {param.spec}: {param.name} is a float field; use float:A:B or log:A:B")
    if param.kind == "log" and kind is int:
        if not all(float(v).is_integer() for v in (param.low, param.high)):
            raise ValueError(f"--param {param.spec}: {param.name} is an int field; LOW and HIGH must be ints")
        return replace(param, low=int(param.low), high=int(param.high), integer=True)
    return param


def check_params(
    given: Sequence[str], config_class: type[TrainConfig], base: TrainConfig, fixed: Iterable[str] = ()
) -> tuple[Param, ...]:
    """The typed params of --param texts: each names a field of the recipe's config once and not
    also --set, every value it can give is within the field's bounds, and the config with either
    end of each range (with the others at the base config's values) passes the config's checks."""
    if not given:
        raise ValueError("nothing to search: give at least one --param NAME=KIND:..., e.g. lr=log:1e-4:1e-1")
    params = [typed_param(parse_param(text), config_class) for text in given]
    seen: set[str] = set()
    fixed = set(fixed)
    for param in params:
        if param.name in seen:
            raise ValueError(f"--param {param.name} is given twice")
        seen.add(param.name)
        if param.name in fixed:
            raise ValueError(f"--param {param.spec}: --set {param.name}=... fixes it too; give one of them")
        for value in param.ends():
            try:
                config_module.apply(base, {param.name: value})
            except (ValueError, TypeError) as error:
                raise ValueError(f"--param {param.spec}: {param.name}={value}: {error}") from None
    return tuple(params)


def metric_and_direction(
    metrics: Sequence[str], config: TrainConfig, metric: str | None, direction: str | None
) -> tuple[str, str]:
    """--metric (default: the config's monitor, else the recipe's first test metric, else the
    training loss) and --direction (default: the way that metric is better: the config's mode, or
    what hvdtrain knows of it)."""
    names = metrics_module.reported(metrics)
    chosen = metric or config.monitor or (names[1] if len(names) > 1 else names[0])
    if chosen not in names:
        raise ValueError(f"--metric {chosen}: the recipe reports {', '.join(names)}; choose one of those")
    if direction is not None:
        words = {"max": "maximize", "min": "minimize", "maximize": "maximize", "minimize": "minimize"}
        if direction not in words:
            raise ValueError(f"--direction {direction}: choose maximize or minimize")
        return chosen, words[direction]
    mode = config.mode if chosen == config.monitor else "auto"
    try:
        goal = metrics_module.goal(chosen, mode)
    except ValueError:
        raise ValueError(
            f"--metric {chosen}: hvdtrain does not know whether higher or lower is better; "
            "give --direction maximize or minimize"
        ) from None
    return chosen, "maximize" if goal == "max" else "minimize"


def grid_space(params: Sequence[Param]) -> dict[str, list[Any]]:
    space = {param.name: list(param.grid_values()) for param in params}
    if math.prod(len(values) for values in space.values()) > GRID_MOST:
        raise ValueError(f"--sampler grid: more than {GRID_MOST} points; narrow the int ranges")
    return space


def grid_size(params: Sequence[Param]) -> int:
    return math.prod(len(values) for values in grid_space(params).values())


def default_sweep_dir(runs: Path, recipe: str, stamp: str) -> Path:
    return runs / f"sweep-{Path(recipe).stem if '/' in recipe or recipe.endswith('.py') else recipe}-{stamp}"


def newest_sweep_dir(runs: Path, recipe: str, names: Iterable[str]) -> Path | None:
    """--resume without --sweep-dir: the newest runs/sweep-RECIPE-TIMESTAMP of this recipe."""
    stem = default_sweep_dir(runs, recipe, "").name
    found = sorted(name for name in names if name.startswith(stem) and SWEEP_STAMP.match(name))
    return runs / found[-1] if found else None


def trial_dir(sweep_dir: Path, number: int) -> Path:
    return sweep_dir / TRIAL_DIR.format(number=number)


def set_text(value: Any) -> str:
    """A value as --set reads it back exactly (floats by repr, so the trial is the one sampled)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return repr(value)
    return str(value)


def trial_request(base: Any, values: Mapping[str, Any], run_dir: Path | None) -> Any:
    """The RunRequest of one trial: the sweep's run options, its fixed --set, then the trial's values."""
    sets = tuple(f"{name}={set_text(value)}" for name, value in values.items())
    return dataclasses.replace(base, overrides=(*base.overrides, *sets), run_dir=run_dir)


def resume_request(base: Any, run_dir: Path) -> Any:
    """A trial's run again after the sweep was stopped: --resume in its run directory, from its
    saved config (so no --variant or --set, as --max-restarts resumes)."""
    return dataclasses.replace(
        base, overrides=(), variant=None, resume=True, resume_from=None, run_dir=run_dir
    )


def command_line(argv: Sequence[str]) -> str:
    """`hvdtrain run ...` of run_argv's arguments, as a shell takes it."""
    return shlex.join(["hvdtrain", "run", *argv])


STATES = ("complete", "pruned", "failed", "running")


@dataclass(frozen=True)
class TrialRow:
    """One trial as the sweep shows it and sweep.json records it."""

    number: int
    state: str
    """complete, pruned, failed, or running (also a trial a stopped sweep goes on with next time)."""
    params: dict[str, Any]
    value: float | None
    epochs: int
    run_dir: str
    reason: str = ""
    """Why a trial failed (its run's status and last line)."""

    def record(self) -> dict[str, Any]:
        found = {
            "number": self.number,
            "state": self.state,
            "params": self.params,
            "value": self.value,
            "epochs": self.epochs,
            "run_dir": self.run_dir,
        }
        return found | ({"reason": self.reason} if self.reason else {})


def best_of(rows: Sequence[TrialRow], direction: str) -> TrialRow | None:
    done = [row for row in rows if row.state == "complete" and row.value is not None]
    if not done:
        return None
    pick = max if direction == "maximize" else min
    return pick(done, key=lambda row: (row.value if direction == "maximize" else row.value, -row.number))


def sweep_record(
    settings: Mapping[str, Any], rows: Sequence[TrialRow], best: TrialRow | None, reproduce: str | None
) -> dict[str, Any]:
    """sweep.json: what was searched, every trial, the best and the line that reproduces it."""
    record = dict(settings)
    record["trials"] = [row.record() for row in sorted(rows, key=lambda row: row.number)]
    record["counts"] = {state: sum(row.state == state for row in rows) for state in STATES}
    record["best"] = None if best is None else {**best.record(), "command": reproduce}
    return record


def shown_value(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def params_cell(params: Mapping[str, Any]) -> str:
    return " ".join(f"{name}={shown_value(value)}" for name, value in params.items())


def table_lines(rows: Sequence[TrialRow], metric: str) -> list[str]:
    """The trial table, in `hvdtrain runs`' style: a header, then one aligned line per trial."""
    header = ("trial", "params", "state", metric, "epochs")
    cells = [
        (str(row.number), params_cell(row.params), row.state, shown_value(row.value), str(row.epochs))
        for row in sorted(rows, key=lambda row: row.number)
    ]
    widths = [max(len(line[i]) for line in [header, *cells]) for i in range(len(header))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
            for line in [header, *cells]]  # fmt: skip


def row_line(row: TrialRow, metric: str) -> str:
    """One trial's line as it changes, for a log file or a pipe."""
    line = f"trial {row.number:<3} {row.state:<8} {metric}={shown_value(row.value)}  epochs={row.epochs}"
    line += f"  {params_cell(row.params)}"
    return line + (f"  ({row.reason})" if row.reason else "")
