"""What every run records about itself besides its config (docs/architecture.md, "Conventions")."""

from __future__ import annotations

import importlib.metadata
import platform
import subprocess
import sys
from pathlib import Path

import jax

LIBRARIES = (
    "jax",
    "jaxlib",
    "flax",
    "optax",
    "orbax-checkpoint",
    "hydra-core",
    "omegaconf",
    "wandb",
    "numpy",
    "tokenizers",
)


def git_commit() -> dict:
    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return {"commit": None, "dirty": None}
    if commit.returncode != 0:
        return {"commit": None, "dirty": None}
    return {"commit": commit.stdout.strip(), "dirty": bool(dirty.stdout.strip())}


def library_versions() -> dict:
    out = {"python": platform.python_version()}
    for lib in LIBRARIES:
        try:
            out[lib] = importlib.metadata.version(lib)
        except importlib.metadata.PackageNotFoundError:
            out[lib] = None
    return out


def run_meta(overrides, n_params, flops_per_step, peak, peak_source, model, data_info, resumed_from: int = 0) -> dict:
    dev = jax.devices()[0]
    return {
        "overrides": list(overrides),
        "command": " ".join(sys.argv),
        "git": git_commit(),
        "versions": library_versions(),
        "device": {
            "platform": dev.platform,
            "kind": dev.device_kind,
            "count": jax.device_count(),
            "local_count": jax.local_device_count(),
            "processes": jax.process_count(),
            "peak_flops": peak,
            "peak_flops_source": peak_source,
        },
        "mesh": {"data": 1, "fsdp": 1, "model": 1},  # the step runs on one device until parallel/ shards it
        "params": n_params,
        "flops_per_step": flops_per_step,
        "model": model,
        "data": data_info,
        "resumed_from_step": resumed_from,
    }
