"""Peak FLOP/s of the devices, for MFU (model FLOPs utilisation, PaLM arXiv 2204.02311 app. B).

Accelerators: a table of published dense bf16 peaks per chip (parallel/devices.py), where MFU
means what it says. CPU has no datasheet peak: a float32 matmul probe is kept per machine and
settings (beside the data, `data.cache_dir`), checked against a fresh probe at every run and
raised to it when the fresh one is faster (a probe taken under load reads low); the check's ratio
goes with the peak's source. A benchmark measures its peak in its own process, between its steps
(`PeakMeter`). An MFU above 100 % is an error (`mfu`): its peak cannot be the machine's.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from dalle_ablate.fileio import atomic_write
from dalle_ablate.parallel.devices import DEVICES

# A stored probe's check at every run, and a benchmark's probe between its steps: the best of this
# many n x n matmuls (each 2n^3 FLOPs, ~5-20 ms at n = 1024 on this project's 2-core machine).
CHECK_REPEATS = 3
# Dense bf16 peak FLOP/s per device, by the device_kind JAX reports (parallel/devices.py).
PEAK_FLOPS = {kind: spec.peak for spec in DEVICES.values() for kind in spec.kinds}


def matmul_probe(n: int = 1024, repeats: int = 10) -> float:
    """Achieved float32 FLOP/s of one device on an n x n matmul (best of `repeats`)."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def machine_key(kind: str) -> str:
    """What a CPU probe depends on: the processor, the cores JAX may use, its version and flags."""
    model = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        model = next(
            (
                line.split(":", 1)[1].strip()
                for line in cpuinfo.read_text().splitlines()
                if line.startswith("model name")
            ),
            model,
        )
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()  # Linux only
    flags = os.environ.get("XLA_FLAGS", "")
    return f"{kind}|{model}|{os.cpu_count()} cores|{usable} usable|jax {jax.__version__}|XLA_FLAGS={flags}"


def cached_probe(path: Path, kind: str) -> tuple[float, str]:
    """The matmul probe of this machine and settings, kept in `path`, so that the MFU of runs on one
    machine divides by one number (a probe per run moved with the load: 36 to 57 GFLOP/s across
    four runs of one config) -- checked against a fresh probe: the best this machine has done is
    its peak, so a fresh probe above the kept one replaces it. Its source ends in the check's ratio
    (fresh / kept: below 1, the machine is busier now than when the peak was measured)."""
    key = machine_key(kind)
    saved = json.loads(path.read_text()) if path.exists() else {}
    fresh = matmul_probe(repeats=CHECK_REPEATS)
    kept = saved.get(key)
    if kept is None or fresh > kept["flops"]:
        saved[key] = {"flops": fresh, "measured": time.strftime("%Y-%m-%dT%H:%M:%S")}
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps(saved, indent=2))
    ratio = fresh / kept["flops"] if kept is not None else 1.0
    peak = saved[key]
    return peak["flops"], f"probe:{kind}:matmul-f32-1024:{path}@{peak['measured']}; fresh/kept {ratio:.2f}"


def mfu(flops_per_s: float, peak: float, source: str) -> float:
    """flops_per_s / peak; an error above 1: no step does more than its peak, so that peak is not the
    machine's (a probe under load, or of another dtype than the step's matmuls)."""
    ratio = flops_per_s / peak
    if ratio > 1:
        raise PeakBelowStep(
            f"MFU {ratio:.0%} is above 100 %: the step did {flops_per_s / 1e9:.3g} GFLOP/s, more than the peak "
            f"{peak / 1e9:.3g} GFLOP/s ({source}); that peak is not this machine's (measured under load, or for "
            "float32 while the step's matmuls are bfloat16)"
        )
    return ratio


class PeakBelowStep(ValueError):
    """A step faster than the peak MFU divides it by."""


class PeakMeter:
    """A benchmark's peak measured in its own process, between the steps it divides: `sample()`
    after each round of steps; `peak` the best probe so far (a busy moment reads low, never high)."""

    def __init__(self, kind: str):
        self.kind, self.samples = kind, []

    def sample(self) -> None:
        self.samples.append(matmul_probe(repeats=CHECK_REPEATS))

    @property
    def peak(self) -> float:
        return max(self.samples)

    @property
    def source(self) -> str:
        lo, hi = min(self.samples), max(self.samples)
        return f"probe:{self.kind}:matmul-f32-1024, best of {len(self.samples)} between the steps ({lo / hi:.2f}-1.00 of it)"


def device_peak_flops(device=None, cache_dir: str | Path | None = None) -> tuple[float, str]:
    """(peak FLOP/s of one device, where the number comes from): the datasheet of an accelerator;
    on CPU the matmul probe, cached under `cache_dir` (measured afresh without one)."""
    device = device or jax.devices()[0]
    kind = device.device_kind
    if kind in PEAK_FLOPS:
        return PEAK_FLOPS[kind], f"table:{kind}"
    for name, peak in PEAK_FLOPS.items():
        if kind.startswith(name):
            return peak, f"table:{name}"
    if cache_dir is not None:
        return cached_probe(Path(cache_dir).expanduser() / "matmul_probe.json", kind)
    return matmul_probe(), f"probe:{kind}:matmul-f32-1024"
