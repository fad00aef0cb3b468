"""The peak FLOP/s that MFU divides by: the datasheet for an accelerator, and on CPU one matmul
probe per machine and settings, cached, so that runs on one machine are comparable."""

from __future__ import annotations

import json
from types import SimpleNamespace

from dalle_ablate.train import perf


def test_accelerators_come_from_the_table_by_device_kind():
    assert perf.device_peak_flops(SimpleNamespace(device_kind="TPU v3")) == (61.5e12, "table:TPU v3")
    assert perf.device_peak_flops(SimpleNamespace(device_kind="NVIDIA H100 80GB HBM3")) == (
        989e12,
        "table:NVIDIA H100 80GB HBM3",
    )
    assert (
        perf.device_peak_flops(SimpleNamespace(device_kind="TPU v5 lite pod"))[0] == 197e12
    )  # a longer kind, by prefix


def test_the_cpu_probe_is_measured_once_per_machine_and_settings(tmp_path, monkeypatch):
    measured = iter([40e9, 57e9, 36e9])  # what a probe per run gave under changing load
    monkeypatch.setattr(perf, "matmul_probe", lambda: next(measured))
    monkeypatch.setenv("XLA_FLAGS", "")
    cpu = SimpleNamespace(device_kind="cpu")
    first, source = perf.device_peak_flops(cpu, cache_dir=tmp_path)
    again, _ = perf.device_peak_flops(cpu, cache_dir=tmp_path)
    assert first == again == 40e9 and source.startswith(f"probe:cpu:matmul-f32-1024:{tmp_path / 'matmul_probe.json'}@")
    saved = json.loads((tmp_path / "matmul_probe.json").read_text())
    assert [v["flops"] for v in saved.values()] == [40e9]
    # Other settings (here 8 host devices) are another machine as far as the probe goes.
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert perf.device_peak_flops(cpu, cache_dir=tmp_path)[0] == 57e9
    assert len(json.loads((tmp_path / "matmul_probe.json").read_text())) == 2
    # Without a cache the probe runs every time.
    assert perf.device_peak_flops(cpu)[0] == 36e9
