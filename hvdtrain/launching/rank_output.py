"""Reading what ranks print, whoever started them: the tags launchers put before a rank's line, and
where they keep each rank's files. Every convention comes from the launchers' registry and from the
strategies that start their own processes (ddp's torchrun), so there is one tag parser."""

from __future__ import annotations

import contextlib
import json
import re
from functools import cache
from pathlib import Path

from hvdtrain.launching.spec import RankOutput


@cache
def rank_outputs() -> tuple[RankOutput, ...]:
    """Every registered convention, launchers' first; a convention shared by several is listed once."""
    from hvdtrain import launchers, strategies

    outputs = [launcher.output for launcher in launchers.all_launchers().values()]
    outputs += [strategy.output for strategy in strategies.all_strategies().values() if strategy.output]
    return tuple(dict.fromkeys(outputs))


@cache
def rank_tag() -> re.Pattern[str]:
    """One regex for every registered tag; alternative i's groups are renamed rank{i} and stream{i}."""
    tags = dict.fromkeys(output.tag for output in rank_outputs())
    alternatives = [
        f"(?P<tag{i}>{tag.replace('(?P<rank>', f'(?P<rank{i}>').replace('(?P<stream>', f'(?P<stream{i}>')})"
        for i, tag in enumerate(tags)
    ]
    return re.compile("|".join(alternatives))


@cache
def piece_tag() -> re.Pattern[str] | None:
    """The tags of launchers that tag each piece they read of a rank's output (RankOutput.in_pieces)."""
    tags = dict.fromkeys(output.tag for output in rank_outputs() if output.in_pieces)
    return re.compile("|".join(f"(?:{tag})" for tag in tags)) if tags else None


class WholeLines:
    """A launcher's output line by line as the ranks wrote it, where the launcher tags pieces, not
    lines: `TAG:a partial` then, maybe after other ranks' pieces, `TAG:ly written line` come back
    as `TAG:a partially written line`. Text before a line's first tag is the launcher's own."""

    def __init__(self, tag: re.Pattern[str] | None) -> None:
        self.tag = tag
        self.pending: dict[str, str] = {}
        """A tag -> what its rank wrote of a line not ended yet."""

    def feed(self, line: str) -> list[str]:
        """The lines a line of the launcher's output ends (none, one or several)."""
        starts = [] if self.tag is None else list(self.tag.finditer(line))
        if not starts:
            return [line]
        whole = []
        if starts[0].start() > 0:
            whole.append(line[: starts[0].start()] + "\n")
        for start, after in zip(starts, [*starts[1:], None], strict=True):
            piece = line[start.end() : None if after is None else after.start()]
            if after is None:  # the piece that ends this line ends its rank's line
                whole.append(start.group(0) + self.pending.pop(start.group(0), "") + piece)
            else:
                self.pending[start.group(0)] = self.pending.get(start.group(0), "") + piece
        return whole

    def rest(self) -> list[str]:
        """At the end of the output: the lines ranks left unended."""
        rest = [f"{tag}{text}\n" for tag, text in self.pending.items()]
        self.pending = {}
        return rest


def tagged(match: re.Match[str]) -> tuple[int, str]:
    """The rank and the stream (stdout or stderr) that a match of rank_tag() names."""
    index = match.lastgroup.removeprefix("tag")  # the alternative that matched is the last group closed
    stream = match.groupdict().get(f"stream{index}")
    return int(match.group(f"rank{index}")), f"std{stream or 'out'}"


def rank_output_files(log_dir: Path, stream: str = "stdout") -> dict[int, Path]:
    """rank -> its stdout or stderr file, whichever launcher or strategy wrote them."""
    found: dict[int, Path] = {}
    for output in rank_outputs():
        # newest first: a restarted or requeued torchrun writes an attempt's files anew beside the old
        for path in sorted(log_dir.glob(output.logs.format(stream=stream)), key=_newest_first):
            name = path.parent.name.removeprefix("rank.")
            if name.isdigit():
                found.setdefault(_first_rank(path.parent, log_dir) + int(name), path)
    return found


def _newest_first(path: Path) -> tuple[float, str]:
    try:
        return -path.stat().st_mtime, str(path)
    except OSError:
        return 0.0, str(path)


def _first_rank(folder: Path, log_dir: Path) -> int:
    """N of a `ranks.N` folder between log_dir and a rank's folder, else 0."""
    for parent in folder.relative_to(log_dir).parents:
        if parent.name.startswith("ranks.") and parent.name[len("ranks.") :].isdigit():
            return int(parent.name[len("ranks.") :])
    return 0


def rank_json_records(log_dir: Path) -> list[dict]:
    """The JSON objects ranks printed one per line, read from their own stdout files (the console
    interleaves ranks). Tolerates the launchers' tags, including Open MPI's habit of tagging a
    line's newline as a chunk of its own ('{...}[1,0]<stdout>:')."""
    decoder = json.JSONDecoder()
    found = []
    for path in rank_output_files(log_dir).values():
        for line in path.read_text(errors="replace").splitlines():
            start = line.find("{")
            if start >= 0:
                with contextlib.suppress(json.JSONDecodeError):
                    found.append(decoder.raw_decode(line[start:])[0])
    return found


def rank_stderr_tail(log_dir: Path, rank: int, lines: int = 15) -> list[str]:
    """The last non-empty lines a rank wrote to stderr."""
    path = rank_output_files(log_dir, "stderr").get(rank)
    if path is None:
        return []
    return [line for line in path.read_text(errors="replace").splitlines() if line.strip()][-lines:]
