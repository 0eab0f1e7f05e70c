"""Where hvdtrain keeps what it learns about this machine between runs."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$XDG_CACHE_HOME/hvdtrain, else ~/.cache/hvdtrain (an empty XDG_CACHE_HOME counts as unset)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hvdtrain"
