"""`dalle-ablate study NAME --seeds N|auto`: a finished study topped up with more seeds per arm --
the rule's count (`auto`: the largest seeds-needed over its findings, docs/statistics.md) or the
number given -- and the study's log of its top-ups (report/study_file.py TOPUPS), which its page prints."""

from __future__ import annotations

import json
import time
from pathlib import Path

from dalle_ablate.fileio import atomic_write
from dalle_ablate.registry import ConfigError
from dalle_ablate.report.study_file import TOPUPS, Study
from dalle_ablate.report.findings import _arms_by, claims_tables, judge, topup_rule
from dalle_ablate.report.load import Run, load_runs


def topup_target(study: Study, runs: list[Run]) -> tuple[int, int]:
    """(seeds per arm now, seeds per arm the top-up rule asks for)."""
    by_arm = _arms_by(runs)
    arms, seeds, tables = claims_tables(study, by_arm)
    _, r = judge(study, arms, tables)
    return topup_rule(study, by_arm, r["needed"])


def plan_topup(study: Study, folder: Path, seeds: str, overrides: list[str]) -> tuple[str, dict]:
    """`dalle-ablate study NAME --seeds N|auto`: (the seed override that tops the finished study
    in `folder` up to that many seeds per arm -- its seeds kept, the smallest unused ones added --
    and the entry for its top-up log). `auto` is the rule: the largest seeds-needed over all the
    findings (prose.TOPUP_RULE, docs/statistics.md). One-line errors for what cannot be topped up."""
    if any(o.split("=", 1)[0].lstrip("+~") == "seed" for o in overrides):
        raise ConfigError("--seeds chooses the seeds itself; leave out the seed= override")
    if seeds != "auto" and not (seeds.isdigit() and int(seeds) >= 2):
        raise ConfigError(f"--seeds {seeds!r}: give a number of seeds per arm (2 or more) or auto (the top-up rule)")
    log = Path(folder) / TOPUPS
    done = json.loads(log.read_text()) if seeds == "auto" and log.exists() else []
    if any(t.get("how", "").startswith("--seeds auto") for t in done):  # its error rate is simulated for one look
        raise ConfigError(
            f"--seeds auto: study {study.name} was topped up by the rule already; the rule tops up once "
            "(a second look at the same data would spend its error rate again)"
        )
    try:
        runs = load_runs(str(folder))
    except ConfigError:
        runs = []
    by_arm = _arms_by(runs)
    if not by_arm:
        raise ConfigError(
            f"--seeds tops up a study that has run: no runs of study {study.name} under {folder}; run "
            f"dalle-ablate study {study.name} first"
        )
    now, rule = topup_target(study, runs)
    target = rule if seeds == "auto" else int(seeds)
    if target < now:
        raise ConfigError(f"--seeds {seeds}: study {study.name} already has {now} seeds per arm; a top-up only adds")
    have = sorted({r.seed for rs in by_arm.values() for r in rs if r.seed is not None}, key=str)
    extra = [s for s in range(target + len(have)) if s not in have][: max(0, target - len(have))]
    chosen = [*have, *extra][: max(target, len(have))]
    entry = {
        "from": now,
        "to": target,
        "rule": rule,
        "seeds": chosen,
        "how": "--seeds auto (the rule)" if seeds == "auto" else f"--seeds {seeds}",
    }
    return "seed=" + ",".join(str(s) for s in chosen), entry


def announced(study: Study, folder: Path, seeds: str, overrides: list[str]) -> tuple[str, dict]:
    """`plan_topup`, printed: (the seed override that tops every arm up, the top-up's record)."""
    seed_override, topup = plan_topup(study, folder, seeds, overrides)
    print(
        f"study {study.name}: topping up from {topup['from']} to {topup['to']} seeds per arm ({seed_override}; the "
        f"rule asks for {topup['rule']})"
    )
    return seed_override, topup


def log_topup(folder: Path, topup: dict) -> None:
    """Add a finished top-up to the study's log of them (the page prints the rule it followed)."""
    log = folder / TOPUPS
    atomic_write(
        log,
        json.dumps(
            [
                *(json.loads(log.read_text()) if log.exists() else []),
                {**topup, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
            ],
            indent=1,
        ),
    )
