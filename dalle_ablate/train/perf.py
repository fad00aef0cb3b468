"""Peak FLOP/s of the devices, for MFU (model FLOPs utilisation, PaLM arXiv 2204.02311 app. B).

Accelerators: a table of published dense bf16 peaks per chip. CPU has no meaningful datasheet
peak, so a float32 matmul probe is measured once at start and logged with the run; MFU on CPU
is then "fraction of what this machine's matmul achieves".
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

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


def device_peak_flops(device=None) -> tuple[float, str]:
    """(peak FLOP/s of one device, where the number comes from)."""
    device = device or jax.devices()[0]
    kind = device.device_kind
    if kind in PEAK_FLOPS:
        return PEAK_FLOPS[kind], f"table:{kind}"
    for name, peak in PEAK_FLOPS.items():
        if kind.startswith(name):
            return peak, f"table:{name}"
    return matmul_probe(), f"probe:{kind}:matmul-f32-1024"
