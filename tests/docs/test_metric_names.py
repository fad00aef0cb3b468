"""Every metric a short run writes is documented: its key matches a name in
docs/architecture.md, "Metric names as logged" (`<x>` there stands for one name, or for the rest
of the key where it ends the name)."""

from __future__ import annotations

import json
import re

import pytest

from conftest import EVAL_ON, ROOT, SMALL_DATA, TINY_TRAIN, run_py


def documented_patterns() -> list[re.Pattern]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Metric names as logged", 1)[1].split("\n## ", 1)[0]
    patterns = []
    for name in re.findall(r"`([^`\s]+)`", section):
        # Full names only (a first segment written out, e.g. `train/loss/<stream>`): the fragments
        # the page lists under one (`<tier>/<metric>`, `_lo`) would match anything. Then the
        # counters logged beside every metric.
        if not (re.match(r"[a-z]+/", name) or name in ("samples", "tokens")):
            continue
        parts = re.split(r"(<[^>]+>)", name)
        regex = ""
        for i, part in enumerate(parts):
            if part.startswith("<"):
                regex += ".+" if i == len(parts) - 2 and not parts[-1] else "[^/]+"
            else:
                regex += re.escape(part)
        patterns.append(re.compile(regex))
    return patterns


def test_the_documented_names_parse():
    names = documented_patterns()
    assert any(p.fullmatch("train/loss") for p in names)
    assert any(p.fullmatch("eval/pareto/s3/shapes/one/all") for p in names)
    assert not any(p.fullmatch("train/not_a_metric") or p.fullmatch("nothing") for p in names)


@pytest.mark.slow
def test_every_metric_a_short_run_writes_is_documented(tmp_path):
    proc = run_py(*SMALL_DATA, *TINY_TRAIN, *EVAL_ON, "tracker=none", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    keys = set()
    for line in (tmp_path / "outputs" / "run" / "run" / "metrics.jsonl").read_text().splitlines():
        keys |= set(json.loads(line))
    assert {"train/loss", "eval/valid/loss", "perf/step_time"} <= keys and any(
        k.startswith("eval/pareto/") for k in keys
    ), sorted(keys)
    names = documented_patterns()
    undocumented = sorted(k for k in keys if k not in ("step",) and not any(p.fullmatch(k) for p in names))
    assert undocumented == [], f"metrics written but not named in docs/architecture.md: {undocumented}"
