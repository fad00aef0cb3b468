"""Test environment: W&B offline into a temp dir, a shared data cache, small data settings."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_TMP = Path(tempfile.mkdtemp(prefix="dalle-ablate-tests-"))
# Set before anything imports wandb or builds data; subprocesses inherit them.
os.environ["WANDB_MODE"] = "offline"
os.environ["WANDB_SILENT"] = "true"
for var in ("WANDB_DIR", "WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR"):
    os.environ[var] = str(_TMP / var.lower())
    Path(os.environ[var]).mkdir(parents=True, exist_ok=True)
os.environ.setdefault("DALLE_ABLATE_CACHE", str(_TMP / "cache"))

# Small data that still exercises every path; built once per session (cached on disk).
SMALL_DATA = [
    "data.num_train=1500",
    "data.num_valid=48",
    "data.num_test=48",
    "data.codebook_size=256",
]
TINY_TRAIN = [
    "trainer.steps=6",
    "trainer.batch_size=8",
    "trainer.eval_every=3",
    "trainer.save_every=3",
    "trainer.log_every=2",
    "trainer.progress=false",
    "samples.per_caption=1",
    "samples.captions=[a red circle]",
    "model.d_model=32",
    "model.heads=2",
    "model.ffn_dim=64",
    "model.encoder_layers=1",
    "model.decoder_layers=2",
    "model.text_len=24",
    "eval.num_samples=8",
    "eval.batch_size=8",
    "eval.guidance_scales=[1,3]",
    "eval.sensitivity_examples=8",
    "eval.grid_prompts=1",
    "eval.grid_samples=2",
    # No sampling evaluation in the many short runs of the suite; EVAL_ON turns it back on
    # (tests/test_evaluate.py).
    "eval.metrics=[]",
    "eval.grids=[]",
]
EVAL_ON = ["eval.metrics=[shapes,shapes_fd,caption_sensitivity]", "eval.grids=[shapesbench]"]


def compose(*overrides: str):
    from dalle_ablate.cli import compose as _compose

    return _compose(list(overrides))


def run_config(*overrides: str, data=tuple(SMALL_DATA)):
    from dalle_ablate.config import to_run_config

    return to_run_config(compose(*data, *TINY_TRAIN, *overrides))


def run_py(*args: str, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python run.py ...` in a subprocess, its outputs under cwd."""
    return subprocess.run(
        [sys.executable, str(ROOT / "run.py"), *args, f"hydra.run.dir={cwd}/outputs/run",
         f"hydra.sweep.dir={cwd}/multirun"],
        cwd=cwd, capture_output=True, text=True, timeout=timeout,
    )


@pytest.fixture(scope="session")
def small_dataset():
    from dalle_ablate.data import build_dataset

    cfg = run_config()
    return build_dataset(cfg.data, cfg.model)


# -- long tests ---------------------------------------------------------------------------------
# Tests marked `long` (minutes of end-to-end runs) run when the code could have changed their
# outcome: the record below holds, per test, the hash of the code it last passed on; when the
# code's hash is the same, the test is skipped with that reason. DALLE_ABLATE_LONG=1 runs them
# regardless; every pass updates the record (commit it with the code it passed on).
LONG_RECORD = ROOT / "tests" / "long_tests_passed.json"
_CODE = ("dalle_ablate", "conf", "hydra_plugins", "sweeps", "tests", "run.py", "pyproject.toml")


def code_hash() -> str:
    """SHA-256 of the tracked files of the code (their contents as they are now)."""
    import hashlib

    listed = subprocess.run(["git", "ls-files", "--", *_CODE], cwd=ROOT, capture_output=True, text=True)
    files = sorted(listed.stdout.split()) if listed.returncode == 0 else []
    if not files:  # not a git checkout: no hash, so every long test runs (none is skipped wrongly)
        return "no-git"
    h = hashlib.sha256()
    for name in files:
        f = ROOT / name
        if f == LONG_RECORD or not f.is_file():
            continue
        h.update(name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def _record() -> dict:
    import json

    return json.loads(LONG_RECORD.read_text()) if LONG_RECORD.exists() else {}


def pytest_collection_modifyitems(config, items):
    if os.environ.get("DALLE_ABLATE_LONG") == "1" or not any(i.get_closest_marker("long") for i in items):
        return
    digest = code_hash()
    if digest == "no-git":
        return
    record = _record()
    for item in items:
        if item.get_closest_marker("long") and record.get(item.nodeid) == digest:
            item.add_marker(pytest.mark.skip(reason=f"long test that passed on this exact code ({digest[:12]}); "
                                                    "DALLE_ABLATE_LONG=1 runs it"))


def pytest_runtest_logreport(report):
    if report.when != "call" or not report.passed or "long" not in report.keywords:
        return
    digest = code_hash()
    if digest != "no-git":
        import json

        from dalle_ablate.fileio import atomic_write

        record = _record()
        record[report.nodeid] = digest
        atomic_write(LONG_RECORD, json.dumps(dict(sorted(record.items())), indent=1) + "\n")
