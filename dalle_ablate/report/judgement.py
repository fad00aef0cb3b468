"""A study's findings judged once for its page: one frozen value that the page's sections read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from dalle_ablate.report import staged
from dalle_ablate.report.findings import Judged, claims_tables, compare, course, shared_jobs, topup_rule
from dalle_ablate.report.findings import baseline_sources, metric_spreads
from dalle_ablate.report.load import Run
from dalle_ablate.report.study_file import Study, study_arms


@dataclass(frozen=True)
class Judgement:
    claims: tuple  # findings.claims_tables': (arms, seeds, metric -> values[arm, seed])
    rows: list[Judged]  # one per finding, at both looks of a staged study
    courses: dict[str, tuple]  # finding id -> its course over training (findings.course)
    arms: list[str]  # study_file.study_arms
    topup: tuple[int, int]  # seeds per arm now, and the top-up rule's target (findings.topup_rule)
    spreads: list[tuple]  # each metric's spread over seeds (findings.metric_spreads)
    sources: list[tuple]  # the baseline's seed fields, each metric's sd by it (findings.baseline_sources)


def judge_page(
    study: Study,
    by_arm: dict[str, list[Run]],
    extra: Optional[dict[str, dict[str, dict]]],
    untestable: Optional[dict[str, str]],
    record: Optional[dict],
) -> Judgement:
    """`study`'s findings on its runs by arm; `extra`, `untestable` and `record` as page_sections takes them."""
    arms = study_arms(study, by_arm)
    untestable = {**shared_jobs(study, by_arm), **(untestable or {})}
    claims = claims_tables(study, by_arm, extra)
    if study.stages is not None:  # judged at both looks (report/staged.py)
        rows = staged.judge_study(study, claims, record, untestable)
    else:
        rows = compare(study, claims, untestable=untestable)
    topup = topup_rule(study, by_arm, [r.spread.needed for r in rows])
    spreads, sources = metric_spreads(study, claims), baseline_sources(study, by_arm, claims[2])
    return Judgement(claims, rows, course(study, by_arm, claims[0]), arms, topup, spreads, sources)
