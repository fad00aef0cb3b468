"""Peak FLOP/s of the devices, for MFU (model FLOPs utilisation, PaLM arXiv 2204.02311 app. B).

Accelerators: a table of published dense bf16 peaks per chip. CPU has no meaningful datasheet
peak, so a float32 matmul probe is measured once at start and logged with the run; MFU on CPU
is then "fraction of what this machine's matmul achieves".
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

# Dense bf16 peak FLOP/s per device as JAX reports it (a TPU v2/v3 "device" is one core).
PEAK_FLOPS = {
    "TPU v2": 22.5e12,
    "TPU v3": 61.5e12,
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v6 lite": 918e12,
    "TPU v6e": 918e12,
    "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100 80GB PCIe": 312e12,
    "NVIDIA H100 80GB HBM3": 989e12,
    "NVIDIA H100 PCIe": 756e12,
    "NVIDIA H200": 989e12,
    "NVIDIA L4": 121e12,
    "NVIDIA A10G": 125e12,
    "Tesla V100-SXM2-16GB": 125e12,
    "Tesla V100-SXM2-32GB": 125e12,
}


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
