"""A real PostgreSQL server for a test: Debian's `postgresql` binaries, a cluster made in a temporary
directory, listening on a Unix socket there only (no TCP port), gone with its directory after.

    with PostgresServer() as server:
        url = server.url("optuna")   # postgresql+psycopg2://postgres@/optuna?host=/tmp/...

The server runs as the `postgres` user (PostgreSQL refuses root), so its directory is one of its
own under /tmp, not pytest's tmp_path (private to root).
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

USER = "postgres"
START_TIMEOUT_S = 60


class PostgresError(RuntimeError):
    pass


def binaries() -> Path | None:
    """The newest installed server's bin/ (Debian keeps initdb and pg_ctl out of PATH)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), key=lambda path: int(path.split("/")[4]))
    return Path(found[-1]).parent if found else None


class PostgresServer:
    def __init__(self) -> None:
        self.base = Path()
        self._bin = binaries()

    @property
    def socket_dir(self) -> Path:
        return self.base / "socket"

    def url(self, database: str) -> str:
        return f"postgresql+psycopg2://{USER}@/{database}?host={self.socket_dir}"

    def _as_postgres(self, *argv: str, timeout: float = START_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            ["runuser", "-u", USER, "--", *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=self.base,
        )
        if done.returncode != 0:
            raise PostgresError(
                f"{Path(argv[0]).name} failed: {(done.stderr or done.stdout).strip()[-2000:]}"
            )
        return done

    def __enter__(self) -> PostgresServer:
        if self._bin is None:
            raise PostgresError("PostgreSQL is not installed: make install installs Debian's postgresql")
        user = pwd.getpwnam(USER)
        self.base = Path(tempfile.mkdtemp(prefix="hvdtrain-postgres-"))
        os.chown(self.base, user.pw_uid, user.pw_gid)
        self.socket_dir.mkdir()
        os.chown(self.socket_dir, user.pw_uid, user.pw_gid)
        try:
            data = self.base / "data"
            self._as_postgres(
                str(self._bin / "initdb"), "-D", str(data), "-U", USER, "--auth=trust", "-E", "UTF8"
            )
            options = f"-c listen_addresses='' -k {self.socket_dir} -c fsync=off"
            log = str(self.base / "server.log")
            self._as_postgres(
                str(self._bin / "pg_ctl"), "-D", str(data), "-o", options, "-l", log, "-w", "-t",
                str(START_TIMEOUT_S), "start",
            )  # fmt: skip
        except (PostgresError, subprocess.TimeoutExpired):
            self.close()
            raise
        return self

    def create_database(self, name: str) -> None:
        self._as_postgres(str(self._bin / "createdb"), "-h", str(self.socket_dir), "-U", USER, name)

    def close(self) -> None:
        if (self.base / "data" / "postmaster.pid").exists():
            with contextlib.suppress(PostgresError, subprocess.TimeoutExpired):
                self._as_postgres(
                    str(self._bin / "pg_ctl"), "-D", str(self.base / "data"), "-m", "immediate", "stop"
                )
        shutil.rmtree(self.base, ignore_errors=True)

    def __exit__(self, *_exc: object) -> None:
        self.close()
