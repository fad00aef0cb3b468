"""A study's findings judged once for its page: one frozen value that the page's sections read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from dalle_ablate.report import staged
from dalle_ablate.report.findings import Judged, claims_tables, compare, course, shared_jobs, topup_rule
from dalle_ablate.report.load import Run
from dalle_ablate.report.study_file import Study, study_arms


@dataclass(frozen=True)
class Judgement:
    """What a study's runs say of its findings: the claims tables (findings.claims_tables), one judged row
    per finding (at both looks of a staged study), each finding's course over training, the study's arms
    (study_file.study_arms) and what a top-up would add."""

    claims: tuple
    rows: list[Judged]
    courses: dict[str, tuple]
    arms: list[str]
    topup: tuple[int, int]  # seeds per arm now, and the top-up rule's target (findings.topup_rule)


def judge_page(
    study: Study,
    by_arm: dict[str, list[Run]],
    extra: Optional[dict[str, dict[str, dict]]] = None,
    untestable: Optional[dict[str, str]] = None,
    record: Optional[dict] = None,
) -> Judgement:
    """`study`'s findings judged on its runs by arm; `extra`, `untestable` and `record` as page_sections takes them."""
    arms = study_arms(study, by_arm)
    untestable = {**shared_jobs(study, by_arm), **(untestable or {})}
    claims = claims_tables(study, by_arm, extra)
    if study.stages is not None:  # judged at both looks (report/staged.py)
        rows = staged.judge_study(study, claims, record, untestable)
    else:
        rows = compare(study, claims, untestable=untestable)
    topup = topup_rule(study, by_arm, [r.spread.needed for r in rows])
    return Judgement(claims, rows, course(study, by_arm, claims[0]), arms, topup)
