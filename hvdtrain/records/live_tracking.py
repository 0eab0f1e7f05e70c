"""MLflow while the job runs: a thread of the launching process that makes (or finds again) the run's
MLflow run as the ranks start and logs each line rank 0 appends to metrics.jsonl as it appears
(hvdtrain.records.tracking logs the rest once the job has ended)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hvdtrain.records import tracking
from hvdtrain.runtime.common import RUN_RECORD, atomic_write_bytes, read_json_object

POLL_S = 1.0
"""How often LiveLogging looks for new lines in metrics.jsonl."""
STOP_WAIT_S = 30.0
"""How long the end of the job waits for LiveLogging's MLflow call in flight (making the run, on a
short job): the end-of-job pass would wait as long on the same store."""


class LiveLogging:
    """While the job runs, a thread of the launching process makes (or finds again) the MLflow run
    and logs the config, then logs each whole line rank 0 appends to metrics.jsonl as it appears,
    keeping run.json's entry up to date so that log_run, and a resume, log only what it did not. The
    job never waits on it: a store that fails is said in one line and the thread ends; log_run tries
    again once the job has ended."""

    def __init__(self, uri: str, run_dir: Path, say: Callable[[str], None], every_s: float = POLL_S) -> None:
        self.uri, self.run_dir, self.say, self.every_s = uri, run_dir, say, every_s
        self._stopping = threading.Event()
        self._lock = threading.Lock()  # run.json is this thread's to write only until stop()
        self._closed = False
        self._thread = threading.Thread(target=self._work, name="hvdtrain-mlflow", daemon=True)

    def start(self) -> LiveLogging:
        self._thread.start()
        return self

    def stop(self, wait_s: float = STOP_WAIT_S) -> None:
        """The job has ended: no more lines are read; a call in flight may finish within wait_s."""
        self._stopping.set()
        self._thread.join(wait_s)
        with self._lock:
            self._closed = True

    def _work(self) -> None:
        try:
            client = tracking.mlflow_client(self.uri)
            record = read_json_object(self.run_dir / RUN_RECORD) or {}
            entry, have = tracking.open_run(client, self.uri, self.run_dir, record)
            made = entry != record.get(tracking.RECORD_KEY)  # not the one run.json names
            if not self._save(entry):
                if made:  # run.json will not name it (the job ended first): its end makes its own
                    client.delete_run(entry["run_id"])
                return
            tracking.log_config(client, entry["run_id"], self.run_dir, have, {})
            new_lines = _NewLines(self.run_dir / "metrics.jsonl", skip=entry["logged_lines"])
            while not self._stopping.is_set():
                if lines := new_lines.read():
                    tracking.log_lines(client, entry["run_id"], lines)
                    entry = {**entry, "logged_lines": entry["logged_lines"] + len(lines)}
                    if not self._save(entry):
                        return
                self._stopping.wait(self.every_s)
        except Exception as error:
            if not self._stopping.is_set():
                why = tracking.first_line(error)
                self.say(f"hvdtrain: MLflow at {self.uri}: not logging while the job runs ({why}); "
                         "what is missing is logged when it ends")  # fmt: skip

    def _save(self, entry: dict[str, Any]) -> bool:
        """run.json's entry, unless the job has ended (its own end writes run.json then)."""
        with self._lock:
            record = None if self._closed else read_json_object(self.run_dir / RUN_RECORD)
            if record is not None:
                record[tracking.RECORD_KEY] = entry
                atomic_write_bytes(self.run_dir / RUN_RECORD, (json.dumps(record) + "\n").encode())
            return record is not None


class _NewLines:
    """The records of metrics.jsonl's whole lines appended since the last read, after the first
    `skip` (those logged before), counted as log_run counts them."""

    def __init__(self, path: Path, skip: int) -> None:
        self.path, self.skip, self.offset = path, skip, 0

    def read(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as stream:
                stream.seek(self.offset)
                data = stream.read()
        except OSError:
            return []  # not written yet
        whole = data[: data.rfind(b"\n") + 1]  # a line being written is read once it is whole
        self.offset += len(whole)
        lines = tracking.parse_lines(whole.decode(errors="replace"))
        skipped, self.skip = min(self.skip, len(lines)), max(0, self.skip - len(lines))
        return lines[skipped:]
