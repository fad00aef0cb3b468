"""What W&B writes to the terminal: by default nothing of its own (its `silent` setting) and one line
of the run's saying where the W&B run is; with tracker.wandb.banner=true, W&B's own banner and
closing block. Each case in a process of its own, W&B's WANDB_SILENT (which the suite sets) unset."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

# A W&B run through the tracker option, as a training run builds it: one logged step, a summary, finished.
TRACKED = """
import sys
from pathlib import Path
from dalle_ablate.track import build_tracker
from dalle_ablate.track.wandb_tracker import WandbConfig, WandbTrackerConfig

cfg = WandbTrackerConfig(wandb=WandbConfig(banner=sys.argv[2] == "true"))
tracker = build_tracker(cfg, Path(sys.argv[1]), {"seed": 0}, {}, name="probe", group=None, job_type="probe")
tracker.log({"train/loss": 2.5}, 1)
tracker.log_summary({"steps": 1})
tracker.finish()
"""


def tracked(tmp_path: Path, banner: bool) -> tuple[list[str], dict]:
    """(the lines the process wrote, stdout and stderr together; the run store's meta.json)."""
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_SILENT", "WANDB_QUIET")}
    proc = subprocess.run(
        [sys.executable, "-c", TRACKED, str(tmp_path / "run"), str(banner).lower()],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    return proc.stdout.splitlines(), json.loads((tmp_path / "run" / "meta.json").read_text())


def test_wandb_says_one_line_by_default_where_its_run_is(tmp_path):
    lines, meta = tracked(tmp_path, banner=False)
    assert len(lines) == 1, lines
    prefix, suffix = "W&B run (offline): ", "; upload it with wandb sync"
    assert lines[0].startswith(prefix) and lines[0].endswith(suffix), lines[0]
    folder = Path(lines[0][len(prefix) : -len(suffix)])
    # The folder `wandb sync` takes: this run's, holding its record file.
    assert (folder / f"run-{meta['wandb_id']}.wandb").is_file()


def test_wandb_banner_true_shows_wandb_s_own_output(tmp_path):
    lines, meta = tracked(tmp_path, banner=True)
    own = [line for line in lines if line.startswith("wandb:")]
    assert not any(line.startswith("W&B run") for line in lines), lines
    # Its header, and its closing block with the run's history and summary and the sync command.
    assert any("Run data is saved locally in" in line for line in own), own
    assert any(line.strip() == "wandb: Run summary:" for line in own), own
    assert any(line.startswith("wandb: wandb sync ") and meta["wandb_id"] in line for line in own), own
