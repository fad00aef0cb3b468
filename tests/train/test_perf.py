"""The peak FLOP/s that MFU divides by: the datasheet for an accelerator; on CPU a matmul probe per
machine and settings, kept and checked against a fresh one at every run (raised by a faster one),
or a benchmark's own probes between its steps; an MFU above 100 % an error."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

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


def test_the_cpu_probe_is_kept_per_machine_and_settings_and_raised_by_a_faster_fresh_one(tmp_path, monkeypatch):
    # What a probe gave at each run under changing load: the kept peak is the best so far.
    measured = iter([40e9, 30e9, 57e9, 36e9, 20e9])
    monkeypatch.setattr(perf, "matmul_probe", lambda repeats=10: next(measured))
    monkeypatch.setenv("XLA_FLAGS", "")
    cpu = SimpleNamespace(device_kind="cpu")
    path = tmp_path / "matmul_probe.json"
    first, source = perf.device_peak_flops(cpu, cache_dir=tmp_path)
    assert (
        first == 40e9 and source.startswith(f"probe:cpu:matmul-f32-1024:{path}@") and source.endswith("fresh/kept 1.00")
    )
    again, source = perf.device_peak_flops(cpu, cache_dir=tmp_path)  # a busier moment: the kept peak stays
    assert again == 40e9 and source.endswith("; fresh/kept 0.75")
    assert [v["flops"] for v in json.loads(path.read_text()).values()] == [40e9]
    raised, source = perf.device_peak_flops(cpu, cache_dir=tmp_path)  # the kept one was taken under load
    assert raised == 57e9 and source.endswith("; fresh/kept 1.43")
    assert [v["flops"] for v in json.loads(path.read_text()).values()] == [57e9]
    # Other settings (here 8 host devices) are another machine as far as the probe goes.
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert perf.device_peak_flops(cpu, cache_dir=tmp_path)[0] == 36e9
    assert len(json.loads(path.read_text())) == 2
    # Without a cache the probe runs every time.
    assert perf.device_peak_flops(cpu)[0] == 20e9


def test_an_mfu_above_100_percent_is_an_error_saying_why():
    assert perf.mfu(30e9, 40e9, "probe:cpu") == 0.75
    assert perf.mfu(40e9, 40e9, "probe:cpu") == 1.0
    with pytest.raises(perf.PeakBelowStep) as e:
        perf.mfu(58e9, 40e9, "probe:cpu:matmul-f32-1024:x@t")
    assert str(e.value) == (
        "MFU 145% is above 100 %: the step did 58 GFLOP/s, more than the peak 40 GFLOP/s "
        "(probe:cpu:matmul-f32-1024:x@t); that peak is not this machine's (measured under load, or for float32 "
        "while the step's matmuls are bfloat16)"
    )


def test_a_benchmarks_peak_is_the_best_probe_between_its_steps(monkeypatch):
    measured = iter([30e9, 45e9, 40e9])
    monkeypatch.setattr(perf, "matmul_probe", lambda repeats=10: next(measured))
    meter = perf.PeakMeter("cpu")
    for _ in range(3):
        meter.sample()
    assert meter.peak == 45e9
    assert meter.source == "probe:cpu:matmul-f32-1024, best of 3 between the steps (0.67-1.00 of it)"


def test_the_probe_is_a_matmul_rate_this_machine_can_reach():
    # the real probe, small: a positive rate below a generous bound on a CPU core's float32 FLOP/s x cores
    rate = perf.matmul_probe(n=256, repeats=3)
    assert 1e8 < rate < 1e12 * os.cpu_count()


def test_a_run_whose_step_beats_its_peak_logs_no_mfu_and_says_why_once(capsys):
    from dalle_ablate.train.logger import StepLogger

    log = StepLogger([object()], None, None, None, None, 1e12, 100, (1.0, "probe:cpu:test"))  # 1 FLOP/s: beaten
    assert list(log._timing()) == ["perf/compile_time"]
    for _ in range(2):
        perf_ = log._timing()
        assert "perf/mfu" not in perf_ and perf_["perf/step_time"] > 0
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("MFU ") and line.endswith(
        "(probe:cpu:test); that peak is not this machine's (measured "
        "under load, or for float32 while the step's matmuls are "
        "bfloat16); perf/mfu is not logged for the rest of this run"
    )
    honest = StepLogger([object()], None, None, None, None, 1.0, 100, (1e30, "table:x"))
    honest._timing()
    assert 0 < honest._timing()["perf/mfu"] < 1
