"""Accelerators by name, as one JAX device sees itself (a TPU v2/v3 device is one core, later
TPUs one chip): memory and the dense bf16 peak, from the vendors' datasheets. `dalle-ablate plan
--device` checks a run's per-device memory and states its step time against them; the trainer's
MFU divides by the peak of the device it runs on (train/perf.py)."""

from __future__ import annotations

from dataclasses import dataclass

from dalle_ablate.registry import ConfigError

GiB = 2**30
MiB = 2**20


@dataclass(frozen=True)
class DeviceSpec:
    kinds: tuple[str, ...]  # jax.Device.device_kind of this accelerator
    memory: int  # bytes of HBM one JAX device has (GPUs: the total nvidia-smi reports)
    peak: float  # dense bf16 FLOP/s of one JAX device


DEVICES = {
    "tpu-v2": DeviceSpec(("TPU v2",), 8 * GiB, 22.5e12),
    "tpu-v3": DeviceSpec(("TPU v3",), 16 * GiB, 61.5e12),
    "tpu-v4": DeviceSpec(("TPU v4",), 32 * GiB, 275e12),
    "tpu-v5e": DeviceSpec(("TPU v5 lite", "TPU v5e"), 16 * GiB, 197e12),
    "tpu-v5p": DeviceSpec(("TPU v5p",), 95 * GiB, 459e12),
    "tpu-v6e": DeviceSpec(("TPU v6 lite", "TPU v6e"), 32 * GiB, 918e12),
    "a100-40gb": DeviceSpec(("NVIDIA A100-SXM4-40GB",), 40960 * MiB, 312e12),
    "a100-80gb": DeviceSpec(("NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe"), 81920 * MiB, 312e12),
    "h100": DeviceSpec(("NVIDIA H100 80GB HBM3",), 81559 * MiB, 989e12),
    "h100-pcie": DeviceSpec(("NVIDIA H100 PCIe",), 81559 * MiB, 756e12),
    "h200": DeviceSpec(("NVIDIA H200",), 143771 * MiB, 989e12),
    "l4": DeviceSpec(("NVIDIA L4",), 23034 * MiB, 121e12),
    "a10g": DeviceSpec(("NVIDIA A10G",), 23028 * MiB, 125e12),
    "v100-16gb": DeviceSpec(("Tesla V100-SXM2-16GB",), 16160 * MiB, 125e12),
    "v100-32gb": DeviceSpec(("Tesla V100-SXM2-32GB",), 32510 * MiB, 125e12),
}


def device_spec(name: str, flag: str = "--device") -> DeviceSpec:
    if name not in DEVICES:
        raise ConfigError(f"{flag} {name!r} is not a known device; valid: {', '.join(DEVICES)}")
    return DEVICES[name]
