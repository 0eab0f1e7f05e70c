"""What the user sees while a job runs: the launchers' output made readable.

Every launcher tags rank output its own way, as it declares (hvdtrain.launching.rank_output reads them all:
mpirun `[1,0]<stdout>:`, horovodrun `[0]<stdout>:`, torchrun `[default0]:`; Ray puts
`(actor pid=...)` before the tag hvdtrain's driver writes). `parse` reduces a line to
(rank, stream, text); `Console` shows rank 0's output as it is, every other rank's with a short
`[rank N]` prefix, and rank 0's progress records (`PROGRESS_MARK` + JSON, written by
`runtime.common.RunLog.progress` in `runtime.progress`'s format) as a bar redrawn in place on a
terminal, or as plain lines when the output is a file or a pipe. The per-rank log files keep
everything, untouched.
"""

from __future__ import annotations

import json
import math
import re
import sys
import threading
from dataclasses import dataclass
from typing import IO, Any

from hvdtrain.launching.rank_output import rank_tag, tagged
from hvdtrain.runtime.progress import PROGRESS_MARK, human

LIVE_PROGRESS_S, PLAIN_PROGRESS_S = 0.5, 15.0
"""A terminal redraws the bar twice a second; a log file gets a progress line every 15 s, so a long
epoch does not look hung in CI and a short one adds no line at all."""

RAY_PREFIX = re.compile(r"(\x1b\[[0-9;]*m)*\([^()]*pid=\d+[^()]*\)(\x1b\[[0-9;]*m)*")
"""What Ray puts before a forwarded actor line: `(BaseHorovodWorker pid=4242, ip=...)`, maybe coloured."""


@dataclass(frozen=True)
class Line:
    rank: int | None
    """None for the launcher's and hvdtrain's own lines."""
    stream: str
    text: str


def parse(raw: str) -> Line:
    """One line of the launcher's output without its tags. Open MPI may tag a line's newline as a
    chunk of its own ('text[1,0]<stdout>:'); Ray puts its actor prefix before the tag."""
    raw = raw.rstrip("\n")
    tag = rank_tag()
    first = tag.search(raw)
    if first is None:
        return Line(None, "stdout", raw)
    rank, stream = tagged(first)
    after, before = raw[first.end() :], raw[: first.start()]
    ray_prefix = RAY_PREFIX.fullmatch(before.strip()) is not None
    text = tag.sub("", after if after.strip() or first.start() == 0 or ray_prefix else before)
    return Line(rank, stream, text)


def duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "-:--"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def plain_progress(record: dict[str, Any]) -> str:
    return (
        f"epoch {record['epoch']}/{record['epochs']}  step {record['step']:,}/{record['steps']:,}  "
        f"{human(record.get('samples_per_sec'))} samples/s  ETA {duration(record.get('eta_s'))}  "
        f"loss {human(record.get('loss'))}"
    )


class Console:
    """Shows a job's output line by line (`feed`), redrawing rank 0's progress on a terminal."""

    def __init__(self, out: IO[str] | None = None, live: bool | None = None) -> None:
        self.out = out or sys.stdout
        self.live = self.out.isatty() if live is None else live
        self._progress = None
        self._task = None
        self._epoch: int | None = None
        self._lock = threading.Lock()  # fed by the runner's reader thread, closed by the main thread

    def feed(self, raw: str, show: bool = True) -> None:
        """One line of launcher output; `show` False hides it (framework noise) unless a progress
        record, which is never printed as text."""
        with self._lock:
            self._feed(raw, show)

    def close(self) -> None:
        """Stop redrawing; lines fed after this are printed plain."""
        with self._lock:
            if self._progress is not None:
                self._progress.stop()
            self._progress, self._task, self._epoch, self.live = None, None, None, False

    def _feed(self, raw: str, show: bool) -> None:
        line = parse(raw)
        if line.text.startswith(PROGRESS_MARK):
            if line.rank in (0, None):
                self._update(line.text[len(PROGRESS_MARK) :])
            return
        if not show:
            return
        if line.rank is None or (line.rank == 0 and line.stream == "stdout"):
            if (
                self._progress is not None
                and self._task is not None
                and line.text.startswith(f"epoch {self._epoch}/")
            ):
                self._progress.remove_task(self._task)  # the epoch's own line replaces its bar
                self._task = None
            self._print(line.text)
        else:
            self._print(f"[rank {line.rank}] {line.text}")

    def _print(self, text: str) -> None:
        if self._progress is not None:
            self._progress.console.out(text, highlight=False)
        else:
            self.out.write(text + "\n")
            self.out.flush()

    def _update(self, payload: str) -> None:
        try:
            record = json.loads(payload)
            epoch, epochs, step, steps = (int(record[k]) for k in ("epoch", "epochs", "step", "steps"))
        except (ValueError, KeyError, TypeError):
            return  # a cut or mangled record costs one redraw, nothing else
        if not self.live:
            self._print(plain_progress(record))
            return
        progress = self._start()
        fields = {
            "rate": human(record.get("samples_per_sec")),
            "loss": human(record.get("loss")),
            "eta": duration(record.get("eta_s")),
        }
        if self._task is not None and epoch != self._epoch:
            progress.remove_task(self._task)
            self._task = None
        if self._task is None:
            self._task = progress.add_task(f"epoch {epoch}/{epochs}", total=steps, **fields)
            self._epoch = epoch
        progress.update(self._task, completed=step, total=steps, **fields)

    def _start(self):
        if self._progress is None:
            from rich.console import Console as RichConsole
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            self._progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[rate]} samples/s  ETA {task.fields[eta]}  loss {task.fields[loss]}"),
                console=RichConsole(file=self.out, force_terminal=True, highlight=False),
                transient=True,
                auto_refresh=True,
                refresh_per_second=4,
            )
            self._progress.start()
        return self._progress
