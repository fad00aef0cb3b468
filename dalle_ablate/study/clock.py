"""A study's time limit (`--time-limit 2h30m`): a job starts only where its cost, measured on the
record's runs of its arm, says it ends in time; one that runs past the limit anyway is stopped by
SIGTERM (it saves its last step), and the study ends with what is left and the command that
continues it (exit 5, RunFailed.TIME_LIMIT)."""

from __future__ import annotations

import re
import statistics
import time
from typing import Optional

from dalle_ablate.registry import ConfigError

_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0}


def parse_duration(text: str) -> float:
    """'2h30m', '90m', '1.5h', '45s' or plain seconds ('600') as seconds; a ConfigError naming the flag."""
    t = text.strip().lower()
    parts = re.fullmatch(r"(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s)?", t)
    if re.fullmatch(r"\d+(?:\.\d+)?", t):
        seconds = float(t)
    elif parts and any(parts.groups()):
        seconds = sum(float(v) * _UNITS[u] for v, u in zip(parts.groups(), "hms") if v)
    else:
        seconds = 0.0
    if not seconds > 0:
        raise ConfigError(f"--time-limit {text!r}: give a positive duration such as 2h30m, 90m, 1.5h or 600 (seconds)")
    return seconds


def words(seconds: float) -> str:
    m = int(round(seconds / 60))
    return f"{m // 60}h{m % 60:02d}m" if m >= 60 else f"{m}m" if m else f"{seconds:.0f}s"


class Clock:
    """The study's deadline and what did not fit before it. `costs`: seconds per run measured,
    by (kind, arm); a job's estimate is its runs times its arm's cost (else the median of the
    kind's arms; none measured: no estimate, and the deadline alone can stop it)."""

    def __init__(self, limit: Optional[float], costs: Optional[dict] = None):
        self.limit = limit
        self.start = time.monotonic()
        self.deadline = None if limit is None else self.start + limit
        self.costs = costs or {}
        self.left_out: list[str] = []  # what was not started, in words
        self.current = ""  # the job started last, in words

    def estimate(self, kind: str, arm: str, runs: int) -> Optional[float]:
        own = self.costs.get((kind, arm))
        kin = [c for (k, _), c in self.costs.items() if k == kind]
        per = own if own is not None else (statistics.median(kin) if kin else None)
        return None if per is None else per * runs

    def fits(self, kind: str, arms: list[str], runs: int, what: str) -> bool:
        """Whether a job of `runs` runs of `arms` may start; if not, `what` is noted as left."""
        self.current = what
        if self.deadline is None:
            return True
        if self.left_out:  # the study's order is kept: nothing after a job that did not fit
            self.left_out.append(what)
            return False
        costs = [self.estimate(kind, a, runs) for a in arms]
        need = sum(c for c in costs if c is not None)
        if time.monotonic() + need > self.deadline:
            self.left_out.append(what)
            return False
        return True

    def used(self) -> float:
        return time.monotonic() - self.start
