"""Writing files so that a crash or a concurrent writer never leaves a torn one."""

from __future__ import annotations

import os
from pathlib import Path


def atomic_write(path: Path, text: str) -> None:
    """Write to a temporary name of this process, then rename over the target (atomic on POSIX)."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
