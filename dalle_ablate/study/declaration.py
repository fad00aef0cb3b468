"""A study's declaration as a record freezes it (study/record.py): what its verdicts will judge
and how its runs are made, taken from its file, its experiment preset and the command's overrides
when stage 1 starts. Every later invocation, and every page, derives it again and is refused,
in one line naming the first difference, unless it is the same: a changed design is a new
declaration on fresh seeds (a new record), never an edit of one whose runs were seen."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Optional

from dalle_ablate.registry import ConfigError
from dalle_ablate.report.study_file import Study, load_stress, own_arms, swept_seeds
from dalle_ablate.report.load import NOT_A_VARIANT, flatten
from dalle_ablate.track.naming import key_of

# The command's overrides that choose which runs it trains now and how it resumes them, not what
# they are: a study continued with `+arm=baseline`, some of its seeds or `resume=auto` is the same study.
CHOOSERS = ("arm", "seed", "seeds", "members.impl", "hydra/launcher", "resume")


def declare(study: Study, study_file: Path, overrides: list[str], code: dict) -> dict:
    """The declaration of `study` run with `overrides`, by the code `code` (identity.code_of)."""
    plan = load_stress(study_file)
    stress = None
    if plan is not None:
        stress = {
            "claims": [c.id for c in plan.claims],
            "lr": plan.rates,
            "seeds": plan.seeds,
            "steps": plan.steps,
            "overrides": plan.overrides,
        }
    own = own_overrides(overrides)
    return {
        "study": study.name,
        "baseline": study.baseline,
        "findings": [
            {**{k: getattr(f, k) for k in ("id", "arm", "against", "metric", "expect")}, "margin": str(f.margin)}
            for f in study.findings
        ],
        "stages": None if study.stages is None else dataclasses.asdict(study.stages),
        "transition": dataclasses.asdict(study.transition),
        "timing": list(study.timed),
        "stress": stress,
        "protocol": {
            "experiment": study.experiment,
            "overrides": own,
            "arms": own_arms(study),
            "seeds": swept_seeds(study.experiment, overrides),  # stage 1's: a later invocation chooses among them
            "configs": arm_configs(study, own, plan),
        },
        "code": {"numbers": code["numbers"], "libraries": code["libraries"]},
    }


def own_overrides(overrides: list[str]) -> list[str]:
    """The overrides that make a study's runs what they are, each as Hydra reads its value (`false`
    is `False`), sorted: not the choosers, Hydra's own, nor what never makes two runs differ
    (where they write, how they are tracked: load.NOT_A_VARIANT)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    def kept(o: str) -> bool:
        k = key_of(o)
        return k not in CHOOSERS and not k.startswith("hydra") and not unvarying(k)

    parsed = OverridesParser.create().parse_overrides([o for o in overrides if kept(o)])
    return sorted(f"{o.input_line.split('=', 1)[0]}={o.value()!r}" for o in parsed)


def unvarying(key: str) -> bool:
    """A key of load.NOT_A_VARIANT (`tracker.` covers the group `tracker` too)."""
    return any(key == e or (e.endswith(".") and (key.startswith(e) or key == e[:-1])) for e in NOT_A_VARIANT)


def config_digest(config: dict, leave_out: tuple[str, ...] = ()) -> str:
    """A digest of a run's flattened config less what never makes two runs differ (its seeds,
    where it writes, how it is tracked: load.NOT_A_VARIANT) and `leave_out`."""
    drop = (*NOT_A_VARIANT, *leave_out)
    kept = {k: v for k, v in config.items() if not any(k == e or (e.endswith(".") and k.startswith(e)) for e in drop)}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=repr).encode()).hexdigest()[:16]


def arm_configs(study: Study, own: list[str], plan) -> dict:
    """Each arm's config digest as its jobs compose it (validate.compose: what a run's config.yaml
    holds), and each stress arm's less its rate; `own`: the command's overrides every run gets."""
    from omegaconf import OmegaConf

    from dalle_ablate.study.stress_runs import job_command
    from dalle_ablate.validate import compose

    def digest(overrides: list[str], leave_out=()) -> str:
        return config_digest(flatten(OmegaConf.to_container(compose(overrides), resolve=True)), leave_out)

    out = {"runs": {a: digest([f"experiment={study.experiment}", *own, f"+arm={a}"]) for a in own_arms(study)}}
    if plan is not None:
        out["stress"] = {
            a: digest(
                job_command("python", study.experiment, Path("."), a, plan.rates[0], 0, plan, own)[3:-1], ("optim.lr",)
            )
            for a in plan.arms
        }
    return out


def difference(frozen, now, where: str = "") -> Optional[str]:
    """The first place two declarations differ, in words (`where` the path so far), or None."""
    if isinstance(frozen, dict) and isinstance(now, dict):
        for k in list(frozen) + [k for k in now if k not in frozen]:
            if k not in now or k not in frozen:
                return f"{where}{k} is {'gone' if k not in now else 'new'}"
            d = difference(frozen[k], now[k], f"{where}{k}.")
            if d:
                return d
        return None
    if (
        isinstance(frozen, list)
        and isinstance(now, list)
        and all(isinstance(x, dict) and "id" in x for x in frozen + now)
    ):
        a, b = {x["id"]: x for x in frozen}, {x["id"]: x for x in now}
        if list(a) != list(b):
            gone, new = [i for i in a if i not in b], [i for i in b if i not in a]
            what = f"{', '.join(gone)} gone" if gone else f"{', '.join(new)} new" if new else "reordered"
            return f"{where.rstrip('.')}: {what} (declared: {', '.join(a)})"
        for i in a:
            d = difference(a[i], b[i], f"{where}{i}.")
            if d:
                return d
        return None
    if frozen != now:
        return f"{where.rstrip('.')} is {json.dumps(now)}, declared {json.dumps(frozen)}"
    return None


DESIGN = ("study", "baseline", "findings", "stages", "transition", "timing", "stress")  # what a page judges by


def check(frozen: dict, now: dict, record: str, design_only: bool = False) -> None:
    """Refuse, in one line, a study whose declaration now is not the one `record` froze (its
    stage-1 seeds: the command may choose some of them). `design_only`: a page alone, which trains
    nothing -- its findings, stages, late-seed rule, timing and stress plan only."""
    if design_only:
        frozen, now = ({k: d.get(k) for k in DESIGN} for d in (frozen, now))
        d = difference(frozen, now)
        if d is not None:
            raise ConfigError(
                f"record {record}: the study differs from its frozen declaration ({d}); a changed design is a new "
                "declaration on fresh seeds (a new --record)"
            )
        return
    seeds = now["protocol"]["seeds"]
    if seeds and not set(seeds) <= set(frozen["protocol"]["seeds"] or []):
        raise ConfigError(
            f"record {record}: seeds {', '.join(map(str, sorted(set(seeds) - set(frozen['protocol']['seeds'] or []))))} "
            f"are not stage 1's declared seeds ({', '.join(map(str, frozen['protocol']['seeds'] or []))}); choose "
            "among those, or declare a new study"
        )
    now = {**now, "protocol": {**now["protocol"], "seeds": frozen["protocol"]["seeds"]}}
    d = difference(frozen, now)
    if d is None:
        return
    if d.startswith("code."):
        raise ConfigError(
            f"record {record}: the code that decides the runs' numbers differs from the code its declaration "
            f"froze ({d}); continue it from a checkout of the commit its runs name (git worktree add), or "
            "declare a new study on fresh seeds"
        )
    raise ConfigError(
        f"record {record}: the study differs from its frozen declaration ({d}); a changed design is a new "
        "declaration on fresh seeds (a new --record)"
    )
