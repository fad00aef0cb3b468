"""The run store's one line when its folder cannot be written (track/runstore.py): the end-to-end
cases, a training run's, are in tests/train/test_faults.py."""

from __future__ import annotations

import os
import subprocess

import pytest

from dalle_ablate.registry import RunFailed
from dalle_ablate.track.runstore import RunStore


@pytest.mark.parametrize(
    "meta, again", [({"evaluated_step": 6}, "run the same dalle-ablate eval again"), ({}, "resume=auto")]
)
def test_a_store_that_cannot_be_written_says_what_continues_once_it_is_fixed(tmp_path, meta, again):
    """Issue 72: `dalle-ablate eval`'s store (its meta names the evaluated step) is written again by
    the same command, not by `resume=auto`, the trainer's field that eval has none of."""
    root = tmp_path / "evals" / "default_step6"
    root.mkdir(parents=True)
    lock, unlock = (["chattr", "+i"], ["chattr", "-i"]) if os.geteuid() == 0 else (["chmod", "555"], ["chmod", "755"])
    subprocess.run([*lock, str(root)], check=True)
    try:
        with pytest.raises(RunFailed) as e:
            RunStore(root, {}, meta)
    finally:
        subprocess.run([*unlock, str(root)], check=True)
    why = "EPERM: Operation not permitted" if os.geteuid() == 0 else "EACCES: Permission denied"
    assert (
        str(e.value) == f"run store {root} cannot be written (media): {why}; free space or fix the folder, then {again}"
    )
