"""Typed training configs and `--set key=value` overrides.

Precedence, lowest first: the fields' defaults in `TrainConfig`, the recipe's own `Config`
subclass, the recipe variant, then `--set` on the command line.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

C = TypeVar("C", bound="TrainConfig")


def bounded(
    default: Any, *, minimum: float | None = None, above: float | None = None, maximum: float | None = None
):
    """A config field with bounds that `validate` checks before any rank starts, e.g.
    `hidden: int = bounded(128, minimum=1)`."""
    limits = {"min": minimum, "gt": above, "max": maximum}
    return field(default=default, metadata={key: value for key, value in limits.items() if value is not None})


@dataclass(kw_only=True)
class TrainConfig:
    """Fields every recipe has; a recipe subclasses this and adds or re-defaults fields."""

    epochs: int = bounded(10, minimum=1)
    """Passes over the training set."""
    batch_size: int = bounded(32, minimum=1)
    """Samples per rank per step; the global batch is batch_size x world size."""
    lr: float = bounded(0.05, above=0)
    """Learning rate for one rank; multiplied by the world size when scale_lr is on."""
    scale_lr: bool = True
    """Scale the learning rate linearly with the world size (Goyal et al., 2017)."""
    warmup_epochs: float = bounded(0.0, minimum=0)
    """Epochs over which the scaled learning rate ramps up from lr."""
    lr_schedule: Literal["constant", "step", "cosine", "linear"] = "constant"
    """How the learning rate decays after warmup, per step, over training progress (epochs of samples
    seen, so a resize or a resume at another world size keeps it): step multiplies it by lr_gamma at
    each of lr_milestones; cosine and linear take it to min_lr at the last epoch."""
    lr_milestones: tuple[float, ...] = ()
    """lr_schedule=step: the epochs (fractions allowed) at which the lr is multiplied by lr_gamma."""
    lr_gamma: float = bounded(0.1, above=0)
    """lr_schedule=step: the factor at each milestone."""
    min_lr: float = bounded(0.0, minimum=0)
    """lr_schedule=cosine or linear: the learning rate at the end of the last epoch."""
    log_step_lr: bool = False
    """Write every step's learning rate to metrics.jsonl (warmup steps are always written)."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Mixed precision: the forward pass and the loss in bfloat16 or float16 where that is safe,
    weights, gradients' average and optimizer in float32; fp16 also scales the loss (dynamically) so
    that small gradients survive, and skips a step whose averaged gradient overflowed."""
    clip_grad_norm: float | None = bounded(None, above=0)
    """Clip the averaged gradient to this global L2 norm, after the allreduce and before the step."""
    stop_on_nonfinite: bool = True
    """Stop the run, on every rank at one step and before any checkpoint of it, once a loss or the
    averaged gradient's norm is not finite (nan, inf); it ends as `diverged`, exit code 4, its last
    finite checkpoint kept (docs/reliability.md)."""
    nonfinite_patience: int = bounded(0, minimum=0)
    """Skip up to this many steps in a row whose averaged gradient is not finite (their update is not
    applied) before the run stops as diverged; each step then reads its gradient's norm. fp16's loss
    scale skips overflowing steps itself, and stops after max(this, 24) in a row."""
    slow_rank_every_steps: int = bounded(10, minimum=0)
    """Every this many steps the ranks compare their times to be ready to average gradients (data,
    forward and backward, no wait) in one small collective, to name a slow rank (docs/reliability.md);
    0: never."""
    slow_rank_factor: float = bounded(1.5, above=1)
    """A rank is slow at a check where its mean time to ready exceeds this times the other ranks'
    median."""
    slow_rank_checks: int = bounded(3, minimum=1)
    """Checks in a row at which a rank is slow before it is named, in one line and in summary.json."""
    momentum: float = bounded(0.9, minimum=0, maximum=1)
    """SGD momentum."""
    seed: int = 42
    """Seeds the model init, the data split and the shuffling."""
    steps_per_epoch: int = bounded(0, minimum=0)
    """Stop each epoch after this many steps; 0 means a full pass."""
    sync_batch_norm: bool = False
    """BatchNorm layers normalize over the global batch (every rank's samples), in training; torch
    recipes under horovod or ddp."""
    compile: bool = False
    """torch.compile the model's forward (its state_dict keeps its names) and the loss: inductor's
    kernels, built with the machine's C++ compiler on a CPU; costs start-up time (docs/training.md);
    torch recipes."""
    compile_scope: Literal["model", "blocks"] = "model"
    """With compile: the whole model's forward, or each of the recipe's blocks (a transformer's
    layers) one by one: regional compilation, compiled once for identical blocks; torch recipes."""
    deterministic: bool = False
    """torch's deterministic algorithms (and cuBLAS's fixed workspace), so that on a GPU two runs, or a
    run and its resumed twin, compute the same bits; slower; torch recipes."""
    memory_format: Literal["auto", "channels_last", "contiguous"] = "auto"
    """How image batches and conv weights lie in memory; auto: channels_last for a conv net on a GPU,
    as its convolution kernels want; torch recipes."""
    fp16_allreduce: bool = False
    """Compress gradients to fp16 for the allreduce."""
    backward_passes_per_step: int = bounded(1, minimum=1)
    """Accumulate gradients locally over this many batches before each allreduce."""
    reduce_op: Literal["average", "adasum"] = "average"
    """How gradients are combined across ranks."""
    zero_stage: Literal[1, 2] = 1
    """Under --strategy zero: 1 shards the optimizer state across ranks, 2 also the averaged gradient
    (the full gradients are freed once reduced)."""
    checkpoint: bool = True
    """Write a checkpoint (rank 0, atomically) at the end of every epoch."""
    checkpoint_every_steps: int = bounded(0, minimum=0)
    """Also checkpoint every this many steps within an epoch, so that --resume continues at that
    batch (torch recipes); 0: at epochs' ends only."""
    keep_checkpoints: int = bounded(1, minimum=1)
    """Checkpoints kept in checkpoints/: the newest k; an older one goes once a newer is complete."""
    async_checkpoint: bool = False
    """Write checkpoints in the background: the step waits only for the state's copy into host
    memory, a thread serializes and writes it (atomically, manifest last), one write at a time; a
    stop, a preemption and the run's end wait for it (torch recipes, whole checkpoints)."""
    monitor: str = ""
    """The metric that picks checkpoints/best and stops early: loss (training) or test_<name> of a
    metric the recipe reports, e.g. test_accuracy; empty: none."""
    mode: Literal["auto", "min", "max"] = "auto"
    """Whether lower or higher `monitor` is better; auto knows accuracy, top5, loss and perplexity."""
    early_stopping_patience: int = bounded(0, minimum=0)
    """Stop after this many epochs without a better `monitor` (every rank at the same epoch); 0: never."""
    data_dir: str = ""
    """Directory of dataset files, for recipes that read them."""


@dataclass(kw_only=True)
class SyntheticImagesConfig(TrainConfig):
    """The synthetic benchmark shape shared by synthetic-torch and synthetic-tf, so their numbers compare."""

    epochs: int = 3
    steps_per_epoch: int = 20
    lr: float = 0.01
    checkpoint: bool = False
    image_size: int = bounded(32, minimum=4)
    """Side of the square random images."""
    width: int = bounded(64, minimum=1)
    """Channels of the conv layers (2.2M parameters at 64 and 32x32 images)."""
    num_samples: int = bounded(4096, minimum=1)
    """Random images held in memory per rank."""


@dataclass(kw_only=True)
class ImageNetBenchmarkConfig(TrainConfig):
    """The shape of Horovod's `pytorch_synthetic_benchmark.py` and its Keras twin, shared by
    resnet-torch and resnet-tf: random 224x224 images of 1000 classes, batch 32 per rank, plain SGD
    at 0.01 x world size, 10 steps an epoch."""

    epochs: int = 3
    steps_per_epoch: int = 10
    lr: float = 0.01
    momentum: float = 0.0
    checkpoint: bool = False
    image_size: int = bounded(224, minimum=32)
    """Side of the square images (synthetic and digits)."""
    num_classes: int = bounded(1000, minimum=2)
    """Classes of the synthetic labels (ImageNet's 1000, as Horovod's benchmark)."""
    num_samples: int = bounded(320, minimum=1)
    """Synthetic images held in memory per rank."""


def fields_of(config_class: type[TrainConfig]) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(config_class)}


def _coerce(name: str, annotation: Any, raw: str) -> Any:
    origin = typing.get_origin(annotation)
    if origin is Literal:
        choices = {str(choice): choice for choice in typing.get_args(annotation)}  # zero_stage's are ints
        if raw not in choices:
            raise ValueError(f"--set {name}={raw}: choose one of {', '.join(choices)}")
        return choices[raw]
    if origin in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        if raw.lower() in ("none", "null"):
            return None
        return _coerce(name, members[0], raw)
    if annotation is bool:
        lowered = raw.lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"--set {name}={raw}: expected true or false")
    if annotation in (int, float):
        try:
            return annotation(raw)
        except ValueError:
            raise ValueError(f"--set {name}={raw}: expected {annotation.__name__}") from None
    if annotation is str:
        return raw
    if origin in (list, tuple):
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            raise ValueError(f"--set {name}={raw}: expected a list, e.g. [1, 2]") from None
        items = value if isinstance(value, list | tuple) else [value]
        member = (typing.get_args(annotation) or (Any,))[0]
        if member is float and not all(isinstance(v, int | float) and not isinstance(v, bool) for v in items):
            raise ValueError(f"--set {name}={raw}: expected a list of numbers")
        return origin(float(v) for v in items) if member is float else origin(items)
    raise ValueError(f"--set {name}: fields of type {annotation} cannot be set from the command line")


def parse_overrides(config_class: type[TrainConfig], pairs: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """Turn ['lr=0.1', 'epochs=3'] into typed values; unknown keys list the valid ones."""
    hints = typing.get_type_hints(config_class)
    known = fields_of(config_class)
    overrides: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise ValueError(f"--set {pair!r}: expected key=value")
        if key not in known:
            raise ValueError(f"--set {key}: unknown key; valid keys: {', '.join(sorted(known))}")
        overrides[key] = _coerce(key, hints[key], raw.strip())
    return overrides


def validate(config: TrainConfig) -> None:
    """Every number finite and inside its field's bounds, and the fields that go together agreeing;
    the recipe's own __post_init__ checks the rest."""
    _check_bounds(config)
    _check_schedule(config)
    if config.precision == "fp16" and config.reduce_op == "adasum":
        raise ValueError(
            "precision=fp16 with reduce_op=adasum: the loss scale needs the averaged gradient, and "
            "Adasum combines updates (Horovod cannot skip its synchronize); use bf16 or reduce_op=average"
        )
    if config.early_stopping_patience and not config.monitor:
        raise ValueError(
            "early_stopping_patience needs monitor, the metric to watch, e.g. --set monitor=test_accuracy"
        )
    if config.checkpoint_every_steps and not config.checkpoint:
        raise ValueError("checkpoint_every_steps needs checkpoint=true")
    if config.async_checkpoint and not config.checkpoint:
        raise ValueError("async_checkpoint needs checkpoint=true")
    if config.stop_on_nonfinite and config.nonfinite_patience and config.reduce_op == "adasum":
        raise ValueError(
            "nonfinite_patience with reduce_op=adasum: a step is skipped by the averaged gradient's norm, "
            "and Adasum has no average (its ranks apply their own combined deltas)"
        )
    if config.clip_grad_norm is not None and config.reduce_op == "adasum":
        raise ValueError(
            "clip_grad_norm with reduce_op=adasum: Adasum combines the ranks' updates, not an averaged "
            "gradient to clip; use reduce_op=average"
        )


def _check_schedule(config: TrainConfig) -> None:
    milestones = list(config.lr_milestones)
    if config.lr_schedule == "step" and not milestones:
        raise ValueError(
            "lr_schedule=step needs lr_milestones, the epochs to decay at, e.g. --set lr_milestones=[30,60]"
        )
    if milestones and config.lr_schedule != "step":
        raise ValueError(
            f"lr_milestones is read by lr_schedule=step only, not by lr_schedule={config.lr_schedule}"
        )
    if not all(math.isfinite(m) and m > 0 for m in milestones) or milestones != sorted(set(milestones)):
        raise ValueError(f"lr_milestones must be positive epochs in increasing order, got {milestones}")
    if config.lr_schedule in ("cosine", "linear") and config.min_lr >= config.lr:
        raise ValueError(
            f"min_lr must be below lr for lr_schedule={config.lr_schedule}, "
            f"got {config.min_lr} >= {config.lr}"
        )
    if (
        config.warmup_epochs
        and config.lr_schedule in ("cosine", "linear")
        and config.warmup_epochs >= config.epochs
    ):
        raise ValueError(
            f"warmup_epochs ({config.warmup_epochs}) leaves no epochs for "
            f"lr_schedule={config.lr_schedule} to decay over"
        )


def _check_bounds(config: TrainConfig) -> None:
    for spec in dataclasses.fields(config):
        value = getattr(config, spec.name)
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if not math.isfinite(value):
            raise ValueError(f"{spec.name} must be a finite number, got {value}")
        limits = _bounds(type(config), spec.name)
        if "min" in limits and value < limits["min"]:
            raise ValueError(f"{spec.name} must be at least {limits['min']}, got {value}")
        if "gt" in limits and value <= limits["gt"]:
            raise ValueError(f"{spec.name} must be greater than {limits['gt']}, got {value}")
        if "max" in limits and value > limits["max"]:
            raise ValueError(f"{spec.name} must be at most {limits['max']}, got {value}")


def _bounds(config_class: type, name: str) -> dict[str, float]:
    """A field's bounds, also where a subclass re-defaults it with a plain value (`epochs: int = 15`)."""
    limits: dict[str, float] = {}
    for klass in reversed(config_class.__mro__):
        spec = getattr(klass, "__dataclass_fields__", {}).get(name)
        if spec is not None:
            limits.update(spec.metadata)
    return limits


def apply(config: C, overrides: dict[str, Any]) -> C:
    updated = dataclasses.replace(config, **overrides)
    validate(updated)
    return updated


def save(config: TrainConfig, path: Path) -> None:
    from hvdtrain.runtime.common import atomic_write_bytes  # a torn config.json would lose the run

    atomic_write_bytes(
        path, (json.dumps(dataclasses.asdict(config), indent=2, sort_keys=True) + "\n").encode()
    )


def to_json(config: TrainConfig) -> str:
    """One line, for a rank's command: the config travels with the command, not on a shared disk."""
    return json.dumps(dataclasses.asdict(config), sort_keys=True, separators=(",", ":"))


def from_dict(config_class: type[C], values: dict[str, Any]) -> C:
    """A saved config; fields the recipe no longer has are refused, not dropped."""
    if unknown := sorted(set(values) - set(fields_of(config_class))):
        raise ValueError(f"the saved config has fields this recipe does not: {', '.join(unknown)}")
    tuples = {f.name for f in dataclasses.fields(config_class) if isinstance(f.default, tuple)}
    return config_class(
        **{name: tuple(v) if name in tuples and isinstance(v, list) else v for name, v in values.items()}
    )


def load(config_class: type[C], path: Path) -> C:
    return from_dict(config_class, json.loads(path.read_text()))
