"""Verbs over many runs: an ablation report, and a published study (its runs, report and page)."""

from __future__ import annotations

import argparse
import sys

from dalle_ablate.cli.verbs import verb


def _report_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "source",
        help="a multirun or sweep folder, a glob of run stores ('outputs/*/*/run'), either in a "
        "bucket (gs://bucket/sweeps/x), or wandb:ENTITY/PROJECT/GROUP (needs a W&B login and network)",
    )
    p.add_argument("--out", default="reports", help="folder the report's folder goes in (default: reports)")
    p.add_argument("--name", help="the report's folder name (default: from the source path)")
    p.add_argument(
        "--baseline",
        help="the variant the others are compared with, or a unique part of its label, "
        "e.g. model=preln (default: the first value listed; a sweep: the best completed trial)",
    )
    p.add_argument(
        "--margin",
        action="append",
        default=[],
        metavar="METRIC=DELTA",
        help="a margin for a final metric's differences, e.g. eval/valid/loss=2%% (of the baseline's mean) or "
        "eval/valid/loss=0.01: adds the equivalence verdict and the seeds a difference of Δ needs "
        "(repeatable; docs/statistics.md)",
    )
    p.add_argument(
        "--transition-level",
        type=float,
        metavar="LOSS",
        help="the eval/valid/loss a run falls below at its caption-following transition, for the late-seed "
        "view (default: the rule's level for the shapes data, report/transitions.py; docs/statistics.md)",
    )
    p.add_argument(
        "--stages",
        metavar="FILE",
        help="judge the comparisons in two declared stages: FILE's stages: mapping (a study file's) declares them "
        "before stage 1; the report says which seeds stage 2 asks for, and judges both looks (docs/statistics.md)",
    )
    p.add_argument(
        "--wandb-entity", help="with --wandb-project: also save the report to W&B (needs a login and network)"
    )
    p.add_argument("--wandb-project")


@verb(
    "report",
    _report_arguments,
    help="an ablation report of a multirun/sweep folder or a glob of run stores: "
    "reports/<name>/index.html, report.md, runs.csv, wandb_report.json",
)
def cmd_report(args) -> None:
    """An ablation report of a multirun or sweep folder (or a glob of run stores)."""
    import time

    from dalle_ablate.report import build_report
    from dalle_ablate.report.staged import read_stages

    stages = read_stages(args.stages) if args.stages else None  # before any run is read: one line
    t = time.perf_counter()
    skipped: list[str] = []
    folder = build_report(
        args.source,
        args.out,
        args.name,
        args.baseline,
        args.wandb_entity or "",
        args.wandb_project or "",
        skipped,
        margins=_margins(args.margin),
        transition=_transition(args.transition_level),
        stages=stages,
    )
    print(f"wrote {folder}/index.html, report.md, runs.csv, wandb_report.json ({time.perf_counter() - t:.1f} s)")
    if stages is not None:
        print(f"wrote {folder}/stages.json: stage 2's plan (the report's section 'The stages' says why)")
    for why in skipped:  # each also in the report's first section
        print(f"warning: left out, unreadable: {why}", file=sys.stderr)


def _transition(level):
    """--transition-level as the late-seed view's rule (one line naming the flag if not a positive number)."""
    from dalle_ablate.registry import ConfigError
    from dalle_ablate.report.transitions import Rule

    if level is None:
        return Rule()
    if not 0 < level < float("inf"):
        raise ConfigError(f"--transition-level {level:g}: give a positive loss, in nats per image token")
    return Rule(level=level)


def _margins(given: list[str]) -> dict[str, str]:
    """--margin METRIC=DELTA, each checked: a final metric of the report and a positive number or
    percentage (one line naming the flag otherwise)."""
    from dalle_ablate.registry import ConfigError
    from dalle_ablate.report.tables import FINAL_METRICS
    from dalle_ablate.stats.verdicts import parse_margin

    out = {}
    for g in given:
        metric, _, value = g.partition("=")
        if metric not in FINAL_METRICS:
            raise ConfigError(
                f"--margin {g!r}: {metric!r} is not a metric the report compares; valid: {', '.join(FINAL_METRICS)}"
            )
        if parse_margin(value) is None:
            raise ConfigError(
                f"--margin {g!r}: {value!r} is not a margin; give a positive number in the metric's units "
                "(0.01) or a percentage of the baseline's mean (2%)"
            )
        out[metric] = value
    return out


def _study_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "study", help="a study of dalle_ablate/report/studies/ (mega-variants), or a study file of your own (.yaml)"
    )
    p.add_argument(
        "--out",
        default="studies",
        help="folder of the study's runs (default: studies/<name>), or a bucket's (gs://bucket/studies)",
    )
    p.add_argument("--report-out", default="reports", help="folder of the report (default: reports/<name>)")
    p.add_argument(
        "--page-out",
        default="docs/results",
        help="folder of the results page <name>.md and its figures/ (default: docs/results)",
    )
    p.add_argument("--no-run", action="store_true", help="only the report and the page, from the runs there are")
    p.add_argument(
        "--seeds",
        help="top a study that has run up to N seeds per arm (its finished runs are not rerun), or "
        "'auto': to the seeds its page's rule asks for, from each finding's own noise and margin "
        "only (docs/statistics.md)",
    )
    p.add_argument(
        "--no-stress",
        action="store_true",
        help="skip the study's stress runs (its file's `stress:` section: "
        "the stability claims' arms across learning rates)",
    )
    p.add_argument(
        "--record",
        metavar="FOLDER",
        help="the study's record, a folder (kept in git) or a bucket's (gs://...): its declaration frozen at "
        "its first run, each finished run written to it, only the runs it lacks trained, and the page read "
        "from it alone (docs/guides/studies.md, 'A study's record')",
    )
    p.add_argument(
        "--time-limit",
        metavar="DURATION",
        help="stop in time (2h30m, 90m, 600): start no job whose measured cost would end past it, stop a "
        "running one at it (it saves its step), exit 5 with what is left and the command that continues",
    )
    p.add_argument(
        "--no-members",
        action="store_true",
        help="train each seed of an arm as a job of its own, not the "
        "arm's seeds as members of one job (docs/guides/members.md)",
    )
    p.add_argument(
        "overrides",
        nargs="*",
        help="overrides for every run, e.g. trainer.steps=500 '+arm=baseline,bias' "
        "seed=0,1 (a sweep of the preset's own keys replaces it)",
    )


@verb(
    "study",
    _study_arguments,
    help="run a published study's arms with seeds (finished runs are skipped), then its "
    "report and a results page with a verdict per finding",
)
def cmd_study(args) -> None:
    """Run a study's arms and seeds, then its report and its results page (dalle_ablate/study/)."""
    import shlex

    from dalle_ablate import interrupts
    from dalle_ablate.study.clock import parse_duration
    from dalle_ablate.study.runner import run_study

    limit = parse_duration(args.time_limit) if args.time_limit is not None else None

    with interrupts.taken_at_checks():  # its stages and runs stop at their checks: one line, the command that continues
        run_study(
            args.study,
            args.out,
            args.report_out,
            args.page_out,
            list(args.overrides),
            seeds=args.seeds,
            no_run=args.no_run,
            no_stress=args.no_stress,
            members=not args.no_members,
            again=f"dalle-ablate {shlex.join(args.argv)}",
            record=args.record,
            time_limit=limit,
        )
