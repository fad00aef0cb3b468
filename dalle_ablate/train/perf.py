"""Peak FLOP/s of the devices, for MFU (model FLOPs utilisation, PaLM arXiv 2204.02311 app. B).

Accelerators: a table of published dense bf16 peaks per chip (parallel/devices.py), where MFU
means what it says. CPU has no meaningful datasheet peak, so a float32 matmul probe is measured
once per machine and settings (cached beside the data, `data.cache_dir`) and logged with the run;
MFU on CPU is then "fraction of what this machine's matmul achieved when first measured",
comparable between runs on one machine, not between machines.
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
    """The matmul probe of this machine and settings, measured once and kept in `path`, so that
    the MFU of runs on one machine divides by one number (a probe per run moved with the load:
    36 to 57 GFLOP/s across four runs of one config)."""
    key = machine_key(kind)
    saved = json.loads(path.read_text()) if path.exists() else {}
    if key not in saved:
        saved[key] = {"flops": matmul_probe(), "measured": time.strftime("%Y-%m-%dT%H:%M:%S")}
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps(saved, indent=2))
    return saved[key]["flops"], f"probe:{kind}:matmul-f32-1024:{path}@{saved[key]['measured']}"


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
