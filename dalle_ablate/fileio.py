"""Writing files so that a crash or a concurrent writer never leaves a torn one."""

from __future__ import annotations

import os
from pathlib import Path


def atomic_savez(path: Path, **arrays) -> None:
    """np.savez to a temporary name, then rename over the target: a failure never leaves a torn
    .npz where a good one was."""
    import numpy as np

    path = Path(path)
    tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.npz")
    try:
        np.savez(tmp, **arrays)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write(path: Path, text: str) -> None:
    """Write to a temporary name of this process, then rename over the target (atomic on POSIX)."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
