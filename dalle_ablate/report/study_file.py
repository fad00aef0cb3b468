"""What a study is, from its file (studies/<name>.yaml beside this module): its preset, baseline, findings, stress plan
and stages, the arms its runs train, the seeds its preset sweeps (the preset's one reader) and where its runs go.
The file's format: docs/guides/studies.md, "Writing your own study file"."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Optional

import yaml

from dalle_ablate.metrics import STUDY
from dalle_ablate.registry import ConfigError
import dalle_ablate.report.measures  # noqa: F401 -- the report's own measures a study can judge
from dalle_ablate.stats import stages as S
from dalle_ablate.report.load import Run, read_yaml
from dalle_ablate.report.transitions import Rule, rule_from
from dalle_ablate.stats.verdicts import Margin, parse_margin

STUDIES = Path(__file__).parent / "studies"
TOPUPS = "topups.json"  # in a study's folder: each top-up's seeds before and after, and what the rule asked


# -- the study file ------------------------------------------------------------------------------
@dataclass
class Finding:
    id: str
    claim: str
    arm: str  # the arm the claim is about
    against: str  # the arm it is compared with
    metric: str  # a study metric's name (dalle_ablate/metrics.py: STUDY)
    expect: str  # "lower" | "higher": the arm's value against the other's, if the claim holds
    margin: Margin  # Δ, given or the metric's declared one, parsed where the file is read
    note: Optional[str] = None  # what a reader needs to know to read its verdict (how this study tests the claim)

    @property
    def side(self) -> int:  # +1 where the claim is that the arm's value is higher, -1 lower
        return 1 if self.expect == "higher" else -1


@dataclass
class Study:
    name: str
    title: str
    source: str
    experiment: str  # the multirun preset (conf/experiment/) that runs every arm and seed
    baseline: str
    findings: list[Finding]
    scale_note: str = ""  # what this scale can and cannot say, written with the study
    # the late-seed view's rule (report/transitions.py): the file's `transition:`, else the defaults
    transition: Rule = field(default_factory=Rule)
    stages: Optional["Stages"] = None  # the file's `stages:`: a study in two declared stages; None: one
    # the file's `timing: {arms: [...]}`: arms trained as jobs of their own, interleaved seed by seed,
    # so that their step time is one measurement per seed (dalle_ablate/study/runner.py)
    timed: tuple[str, ...] = ()


def study_path(name: str) -> Path:
    path = STUDIES / f"{name}.yaml"
    if not path.exists():
        known = ", ".join(sorted(p.stem for p in STUDIES.glob("*.yaml")))
        raise ConfigError(f"study {name!r} is not one of: {known} (or give a study file, <path>.yaml)")
    return path


def load_study(path: Path) -> Study:
    """A study file read and checked: a one-line ConfigError naming the field and what would be valid."""
    raw = read_yaml(Path(path)) or {}
    where = str(path)
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{where}: not a study file (a YAML mapping with name, title, source, experiment, baseline, "
            f"findings); it holds a {type(raw).__name__}"
        )
    for key in ("name", "title", "source", "experiment", "baseline", "findings"):
        if key not in raw:
            raise ConfigError(f"{where}: missing '{key}'")
    findings = []
    for i, f in enumerate(raw["findings"]):
        keys = [d.name for d in fields(Finding)]
        missing = [k for k in keys if k not in f and k not in ("margin", "note")]
        if missing:
            raise ConfigError(f"{where}: finding {i} lacks {', '.join(missing)}")
        if f["metric"] not in STUDY:
            raise ConfigError(
                f"{where}: finding {f['id']!r} has metric {f['metric']!r}; valid: {', '.join(sorted(STUDY))}"
            )
        if f["expect"] not in ("lower", "higher"):
            raise ConfigError(f"{where}: finding {f['id']!r} has expect {f['expect']!r}; valid: lower, higher")
        margin = f.get("margin", STUDY[f["metric"]].margin or None)
        if margin is None:
            raise ConfigError(
                f"{where}: finding {f['id']!r} has no margin and metric {f['metric']!r} no default one; "
                "give margin: a positive number in the metric's units (0.01) or a percentage of the "
                "baseline's mean (2%)"
            )
        parsed = parse_margin(margin)
        if parsed is None:
            raise ConfigError(
                f"{where}: finding {f['id']!r} has margin {margin!r}; valid: a positive number in the "
                f"metric's units (0.01) or a percentage of the baseline's mean (2%)"
            )
        if not isinstance(f.get("note", ""), str):
            raise ConfigError(f"{where}: finding {f['id']!r} has note {f['note']!r}; give a sentence of text")
        findings.append(
            Finding(**{k: f[k] for k in keys if k not in ("margin", "note")}, margin=parsed, note=f.get("note"))
        )
    stressed = {
        a
        for f in raw["findings"]
        if f["id"] in ((raw.get("stress") or {}).get("claims") or [])
        for a in (f["arm"], f["against"])
    }
    for f in findings:  # a percentage of the baseline's mean needs the baseline measured on that metric
        if STUDY[f.metric].reads == "given" and f.margin.relative and raw["baseline"] not in stressed:
            raise ConfigError(
                f"{where}: finding {f.id!r} has margin {f.margin} of the baseline's {f.metric}, but the "
                f"baseline {raw['baseline']!r} is in no stress claim, so it has none; give an absolute "
                "margin (0.05) or a stress claim with the baseline"
            )
    return Study(
        raw["name"],
        raw["title"],
        raw["source"],
        raw["experiment"],
        raw["baseline"],
        findings,
        raw.get("scale_note", ""),
        rule_from(raw.get("transition"), where),
        stages_from(raw.get("stages"), where),
        timed_from(raw.get("timing"), where),
    )


def timed_from(raw, where: str) -> tuple[str, ...]:
    """A study file's `timing:` (`{arms: [name, ...]}`) as the arms it times, or a one-line error."""
    if raw is None:
        return ()
    arms = raw.get("arms") if isinstance(raw, dict) and set(raw) == {"arms"} else None
    if not isinstance(arms, list) or not arms or not all(isinstance(a, str) for a in arms):
        raise ConfigError(
            f"{where}: timing must be {{arms: [arm, ...]}}, the arms timed as jobs of their own; it holds {raw!r}"
        )
    return tuple(arms)


# -- its stages (docs/statistics.md, "Studies in stages") ----------------------------------------
RULES = ("budget", "even")  # stats/allocation.py's rule; the budget spread over every arm alike
BUDGET_UNITS = ("runs", "cpu_hours")


@dataclass(frozen=True)
class Stages:
    """A study in two stages, declared in its file before stage 1 ran (`stages:`). Stage 1 is the
    seeds its experiment preset sweeps; after it, stage 2's seeds per arm are chosen from what it
    showed by `rule`, spending at most `budget` (runs, or CPU-hours at each arm's measured run
    time), at most `cap` per arm, its seeds `seeds_from`, `seeds_from` + 1, ...; each finding's two
    stage-wise tests are combined by the inverse-normal test of weight `w1` inside Holm's closed
    procedure, with `boundaries` spending α over the two looks (stats/stages.py)."""

    declared: str  # when and at which commit it was declared, in words: the page prints it
    budget: float
    unit: str  # one of BUDGET_UNITS
    seeds_from: int
    cap: int
    w1: float = math.sqrt(0.5)
    boundaries: str = "asOF"
    rule: str = "budget"

    @property
    def combination(self) -> S.Combination:
        return S.Combination(self.w1, self.boundaries)

    def seeds(self, n: int) -> list[int]:
        """Stage 2's first n seeds (every arm's are the same seeds: its k-th pairs with the others')."""
        return list(range(self.seeds_from, self.seeds_from + n))


def stages_from(raw, where: str) -> Optional[Stages]:
    """A study file's `stages:` mapping as Stages, or a one-line error naming the file and the key."""
    if raw is None:
        return None
    keys = ("declared", "budget", "seeds_from", "cap", "w1", "boundaries", "rule")
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: stages must be a mapping of {', '.join(keys)}; it holds {raw!r}")
    for key in raw:
        if key not in keys:
            raise ConfigError(f"{where}: stages has {key!r}; valid: {', '.join(keys)}")
    for key in ("declared", "budget", "seeds_from", "cap"):
        if key not in raw:
            raise ConfigError(f"{where}: stages lacks {key!r} (declare it before stage 1 runs)")
    budget = raw["budget"]
    if not (isinstance(budget, dict) and len(budget) == 1 and next(iter(budget)) in BUDGET_UNITS):
        raise ConfigError(f"{where}: stages.budget is {budget!r}; give one of {{runs: N}}, {{cpu_hours: H}}")
    unit, amount = next(iter(budget.items()))
    if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not amount > 0:
        raise ConfigError(f"{where}: stages.budget.{unit} is {amount!r}; give a positive number")
    for key, low in (("seeds_from", 0), ("cap", 2)):
        v = raw[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ConfigError(f"{where}: stages.{key} is {v!r}; give a whole number >= {low}")
    w1 = raw.get("w1", math.sqrt(0.5))
    if isinstance(w1, bool) or not isinstance(w1, (int, float)) or not 0 < w1 < 1:
        raise ConfigError(
            f"{where}: stages.w1 is {w1!r}; give stage 1's weight in (0, 1), sqrt(n1 / (n1 + n2)) planned"
        )
    kind, rule = raw.get("boundaries", "asOF"), raw.get("rule", "budget")
    if kind not in S.KINDS:
        raise ConfigError(f"{where}: stages.boundaries is {kind!r}; valid: {', '.join(S.KINDS)}")
    if rule not in RULES:
        raise ConfigError(f"{where}: stages.rule is {rule!r}; valid: {', '.join(RULES)}")
    return Stages(str(raw["declared"]), float(amount), unit, raw["seeds_from"], raw["cap"], float(w1), kind, rule)


# -- its stress plan (report/stress.py measures its runs) ---------------------------------------
# The metric a stress claim is judged on (report/findings.py): its per-seed values come from the
# stress runs, not from the study's own runs, which compare arms at one rate where none spikes.
STABILITY_METRICS = ("lr_sensitivity",)
# Keys a stress run sets itself: a study command's own overrides of these are not passed on.
CONTROLLED = (
    "arm",
    "optim.lr",
    "seed",
    "seeds",
    "trainer.steps",
    "hydra.run.dir",
    "hydra.sweep.dir",
    "hydra.sweep.subdir",
)


@dataclass(frozen=True)
class StressClaim:
    id: str
    claim: str
    arm: str
    against: str
    expect: str  # "lower" | "higher": the arm's instability against the other's, if the claim holds


@dataclass
class StressPlan:
    claims: list[StressClaim]
    rates: list[float]
    seeds: list[int]
    steps: int
    overrides: list[str]
    source: str

    @property
    def arms(self) -> list[str]:
        return list(dict.fromkeys(a for c in self.claims for a in (c.arm, c.against)))

    def jobs(self) -> list[tuple[str, float, int]]:
        """(arm, rate, seed) of every stress run, seed-major so that a stopped study has whole seeds."""
        return [(arm, lr, seed) for seed in self.seeds for arm in self.arms for lr in self.rates]


def load_stress(path: Path) -> Optional[StressPlan]:
    """The stress plan of a study file, or None if it has no `stress:` section. Bad values raise a
    one-line ConfigError naming the field and what would be valid."""
    raw = yaml.safe_load(Path(path).read_text()) or {}
    s = raw.get("stress")
    if s is None:
        return None
    where = f"{path}: stress"
    if not isinstance(s, dict):
        raise ConfigError(f"{where} must be a mapping with claims, lr, seeds, steps (and optionally overrides, source)")
    for key in ("claims", "lr", "seeds", "steps"):
        if key not in s:
            raise ConfigError(f"{where} lacks '{key}'")
    findings = {f.get("id"): f for f in raw.get("findings") or []}
    claims = []
    for cid in s["claims"]:
        f = findings.get(cid)
        if f is None:
            raise ConfigError(
                f"{where}.claims names {cid!r}, not a finding of the study; valid: {', '.join(map(str, findings))}"
            )
        if f.get("metric") not in STABILITY_METRICS:
            raise ConfigError(
                f"{where}.claims: finding {cid!r} has metric {f.get('metric')!r}; a stress claim's metric "
                f"must be {' or '.join(STABILITY_METRICS)} (lower is more stable): it is judged on the "
                "stress runs"
            )
        claims.append(StressClaim(cid, str(f.get("claim", cid)), f["arm"], f["against"], f["expect"]))
    try:
        rates = [float(x) for x in s["lr"]]
    except (TypeError, ValueError):
        raise ConfigError(f"{where}.lr={s['lr']!r} must be a list of learning rates") from None
    if len(set(rates)) < 3 or min(rates) <= 0 or rates != sorted(rates) or len(set(rates)) != len(rates):
        raise ConfigError(f"{where}.lr={s['lr']} must be at least 3 distinct positive rates in increasing order")
    seeds = s["seeds"]
    whole = all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in seeds or [None])
    if not seeds or not whole or len(set(seeds)) != len(seeds):
        raise ConfigError(f"{where}.seeds={seeds} must be a non-empty list of distinct integers >= 0")
    steps = s["steps"]
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ConfigError(f"{where}.steps={steps!r} must be an integer >= 1")
    overrides = [str(o) for o in s.get("overrides") or []]
    return StressPlan(claims, rates, list(seeds), steps, overrides, str(s.get("source", "")))


# -- its experiment preset, and where its runs go -----------------------------------------------
def sweeper_params(experiment: str) -> dict:
    """The experiment preset's `hydra.sweeper.params` (conf/experiment/<experiment>.yaml): what
    its multirun sweeps, `seed` among them (its arms are the study file's: own_arms); {} for a
    preset that sweeps nothing or does not exist (composing it names the valid ones)."""
    preset = resources.files("dalle_ablate.conf") / "experiment" / f"{experiment}.yaml"
    raw = yaml.safe_load(preset.read_text()) if preset.is_file() else None
    return (((raw or {}).get("hydra") or {}).get("sweeper") or {}).get("params") or {}


def own_arms(study: Study) -> list[str]:
    """The arms the study's own runs train, from its file alone: its baseline, then every arm a
    finding judged on those runs names (a stability claim's arms train in its stress runs only).
    Adding a claim on a new arm is its `conf/arm/` file and its finding: nothing else lists arms."""
    elsewhere = {name for name, m in STUDY.items() if m.reads == "given"}
    named = [a for f in study.findings if f.metric not in elsewhere for a in (f.arm, f.against)]
    return list(dict.fromkeys([study.baseline, *named]))


def study_arms(study: Study, by_arm: dict[str, list[Run]]) -> list[str]:
    """The study's arms: the baseline and those its own runs train (own_arms), then any
    other that has runs or a finding names."""
    return list(dict.fromkeys([*own_arms(study), *by_arm, *(a for f in study.findings for a in (f.arm, f.against))]))


def swept_arms(study: Study, overrides: list[str]) -> list[str]:
    """The arms a study's multirun runs: its last `+arm=` override's values, else its own arms."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    given = [o for o in overrides if o.split("=", 1)[0].lstrip("+") == "arm"]
    if not given:
        return own_arms(study)
    override = OverridesParser.create().parse_overrides(given[-1:])[0]
    return [str(v) for v in (override.sweep_iterator() if override.is_sweep_override() else [override.value()])]


def swept_seeds(experiment: str, overrides: list[str]) -> Optional[list[int]]:
    """The seeds a study's multirun sweeps: its last `seed=` override's values, else its preset's
    `hydra.sweeper.params.seed`; None if it sweeps no seed (one run per arm)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    given = [o for o in overrides if o.split("=", 1)[0] == "seed"]
    if not given:
        params = sweeper_params(experiment)
        if "seed" not in params:
            return None
        given = [f"seed={params['seed']}"]
    override = OverridesParser.create().parse_overrides(given[-1:])[0]
    values = list(override.sweep_iterator()) if override.is_sweep_override() else [override.value()]
    return [int(v) for v in values]


def stress_folder(study_folder: Path) -> Path:
    """Where a study's stress runs go: beside its own runs, not among them (a reader of the study's
    folder would take them for more seeds of its arms)."""
    study_folder = Path(study_folder)
    return study_folder.with_name(f"{study_folder.name}-stress")


def run_name(arm: str, lr: float, seed: int) -> str:
    return f"{arm}-lr{lr:g}-seed{seed}"
