"""Runs for a report, read from their local run stores (`<job>/run/`: metrics.jsonl, config.yaml,
meta.json, summary.json, tables/, media/), as pandas frames."""

from __future__ import annotations

import glob
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pandas as pd
import yaml

from dalle_ablate import evaluate  # noqa: F401 -- declares the evaluators' metrics the pages read (metrics.py)
from dalle_ablate.config import MEMBER_ONLY
from dalle_ablate.fileio import local_source
from dalle_ablate.registry import ConfigError, first_line
from dalle_ablate.track.naming import variant_labels
from dalle_ablate.track.wandb_api import group_runs

# Config fields that never make two runs different variants: the seeds (runs of one variant
# differ by them; data_seed and init_seed split `seed` into its sources), the sweeper's link,
# where things are written, how progress is shown.
SEEDS = ("seed", "data_seed", "init_seed")
# How runs were made is not what they compare: seeds trained as members of one job
# (train/loop.py train_members) are their separate runs.
NOT_A_VARIANT = (
    *SEEDS,
    "resume",
    "optuna.",
    "tracker.",
    "trainer.progress",
    "distributed.",
    "data.cache_dir",
    *MEMBER_ONLY,
)
NOT_A_CHOICE = tuple(e for e in NOT_A_VARIANT if e not in SEEDS)  # the config diff shows seeds
VALID_EXAMPLES = "eval_valid_examples"  # tables/<this>_<step>.json: the tracker's table eval/valid/examples


@dataclass
class Run:
    name: str
    root: Path  # the run store
    config: dict  # flattened: "optim.lr" -> value
    meta: dict
    summary: dict
    metrics: pd.DataFrame  # one row per logged step (train and eval rows merged), sorted by step
    variant: str = ""
    pareto: Optional[dict] = None  # the last eval_pareto table: columns, rows, line
    grids: list[tuple[str, Path, list[str]]] = field(default_factory=list)  # (key, png, prompts) of the last evaluation
    pareto_steps: dict = field(default_factory=dict)  # step -> that evaluation's eval_pareto table
    valid_losses: Optional[np.ndarray] = None  # each valid scene's NLL at the last validation (its examples table)

    @property
    def seed(self):
        return self.config.get("seed")

    @property
    def arm(self) -> Optional[str]:
        """The study arm the run belongs to: its `+arm=<name>` override."""
        return next((o.split("=", 1)[1] for o in self.meta.get("overrides", []) if o.startswith("+arm=")), None)

    @property
    def status(self) -> str:
        return str(self.summary.get("status", "unknown"))

    @property
    def job_share(self) -> int:
        """How many members trained in this run's job (meta.json's `members`, written by the
        trainer for each member of a `seeds=[...]` job), 1 for a job of its own."""
        return len((self.meta.get("members") or {}).get("seeds") or [self.seed])


def machine_time(runs: list) -> float:
    """Seconds of the machine these runs took: each run's trainer wall time, a job of several
    members once -- its longest member's, since each member records the job's wall time up to
    its own end (a diverged member ends early)."""
    jobs: dict[str, float] = {}
    for i, r in enumerate(runs):
        job = (r.meta.get("members") or {}).get("job_dir") or f"own job {i}"
        jobs[job] = max(jobs.get(job, 0.0), float(r.summary.get("wall_time", 0)))
    return sum(jobs.values())


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, f"{key}."))
        else:
            out[key] = tuple(v) if isinstance(v, list) else v
    return out


def find_stores(source: str) -> list[Path]:
    """Run stores under a multirun/sweep folder, or matched by a glob (of stores or job dirs); in a
    bucket (gs://...), read from their copy in its staging folder, made afresh (fileio.local_source)."""
    given, source = source, local_source(source, "report")
    paths = [Path(p) for p in sorted(glob.glob(source))] if any(c in source for c in "*?[") else [Path(source)]
    stores = []
    for p in paths:
        if (p / "metrics.jsonl").exists():
            stores.append(p)
        elif p.is_dir():
            # not a checkpoint's evaluations (<store>/evals/) nor a job's stage-1 tokenizer (<job>/tokenizer/)
            stores += sorted(
                (
                    m.parent
                    for m in p.rglob("metrics.jsonl")
                    if "evals" not in m.parent.parts and m.parent.name != "tokenizer"
                ),
                key=lambda s: (len(s.parts), str(s)),
            )
    if not stores:
        raise ConfigError(
            f"report: no run stores (folders with metrics.jsonl) under {given!r}; give a multirun or sweep "
            "folder, or a glob such as 'outputs/*/*/run'"
        )
    return stores


# A step's time as a report reads it: to the microsecond. The timer's nanoseconds are below its own
# noise (a step's time moves by milliseconds from one step to the next), and a study's record keeps
# every step's time in a third of the text at this resolution (study/record.py).
STEP_TIME, PER_SECOND = "perf/step_time", 1e6


def by_step(rows: list[dict]) -> pd.DataFrame:
    """Logged rows as one row per step (train and eval rows of one step merged), the step time to
    the microsecond (PER_SECOND)."""
    frame = pd.DataFrame(rows)
    if "step" in frame:
        frame = frame.groupby("step", as_index=False).last()
    if STEP_TIME in frame:
        frame[STEP_TIME] = (frame[STEP_TIME] * PER_SECOND).round() / PER_SECOND
    return frame


def _tables(store: Path, key: str) -> list[Path]:
    """A run store's `tables/<key>_<step>.json` (the tracker's table files), by step."""
    return sorted((store / "tables").glob(f"{key}_*.json"), key=lambda p: int(p.stem.rsplit("_", 1)[1]))


def _last_table(store: Path, key: str) -> Optional[dict]:
    """The last step's table `key` of a run store."""
    tables = _tables(store, key)
    return json.loads(tables[-1].read_text()) if tables else None


def _valid_losses(store: Path) -> Optional[np.ndarray]:
    """Each valid scene's NLL at the last validation (the table eval/valid/examples)."""
    t = _last_table(store, VALID_EXAMPLES)
    if t is None:
        return None
    c = t["columns"].index("loss")
    return np.array([row[c] for row in t["rows"]], np.float64)


# -- a run store's files, each read or named in one line ------------------------------------------
def _text(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot be read ({first_line(e)})") from None


def read_json(path: Path, kind: type = dict) -> Any:
    """A JSON file's value (of `kind`), or a ConfigError naming the file: missing, half-written, not JSON."""
    try:
        value = json.loads(_text(path))
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"{path}: not valid JSON, half-written or corrupt ({e.msg}: line {e.lineno} column {e.colno})"
        ) from None
    if not isinstance(value, kind):
        raise ConfigError(
            f"{path}: holds a JSON {type(value).__name__}, not a{'n' if kind is dict else ''} {kind.__name__}"
        )
    return value


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a JSON-lines file (metrics.jsonl), or a ConfigError naming the file and line."""
    rows = []
    for n, line in enumerate(_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(
                f"{path}: line {n} is not valid JSON, half-written or corrupt ({e.msg}: column {e.colno})"
            ) from None
        if not isinstance(row, dict):
            raise ConfigError(f"{path}: line {n} holds a JSON {type(row).__name__}, not an object")
        rows.append(row)
    return rows


def read_yaml(path: Path) -> Any:
    """A YAML file's value, or a ConfigError naming the file (and where it stops parsing)."""
    try:
        return yaml.safe_load(_text(path))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1} column {mark.column + 1}: " if mark is not None else ""
        raise ConfigError(f"{path}: not valid YAML ({where}{getattr(e, 'problem', None) or first_line(e)})") from None


def load_run(store: Path) -> Run:
    """A run store's files; a ConfigError naming the first that cannot be read (meta.json, summary.json
    and config.yaml may be absent: a run store from before they existed)."""
    meta = read_json(store / "meta.json") if (store / "meta.json").exists() else {}
    summary = read_json(store / "summary.json") if (store / "summary.json").exists() else {}
    raw = read_yaml(store / "config.yaml") if (store / "config.yaml").exists() else {}
    if not isinstance(raw or {}, dict):
        raise ConfigError(f"{store / 'config.yaml'}: holds a YAML {type(raw).__name__}, not a mapping")
    config = flatten(raw or {})
    frame = by_step(read_jsonl(store / "metrics.jsonl"))
    run = Run(store.parent.name, store, config, meta, summary, frame)  # named in load_runs
    run.pareto_steps = {
        float(p.stem.rsplit("_", 1)[1]): json.loads(p.read_text()) for p in _tables(store, "eval_pareto")
    }
    run.pareto = run.pareto_steps[max(run.pareto_steps)] if run.pareto_steps else None
    run.valid_losses = _valid_losses(store)
    prompts: dict[str, list[str]] = {}  # grid key -> its prompts, from the last eval_grids table
    t = _last_table(store, "eval_grids")
    if t is not None:
        from dalle_ablate.evaluate.prompts import slug

        c = {name: i for i, name in enumerate(t["columns"])}
        for row in t["rows"]:
            key = f"{row[c['list']]}/{slug(row[c['category']])}/s{row[c['scale']]:g}"
            if row[c["prompt"]] not in prompts.setdefault(key, []):
                prompts[key].append(row[c["prompt"]])
    paths = [c for c in frame.columns if c.startswith("grids/") and c.endswith("/path")]
    for c in sorted(paths):
        last = frame[c].dropna()
        if len(last):
            key = c[len("grids/") : -len("/path")]
            run.grids.append((key, store / str(last.iloc[-1]), prompts.get(key, [])))
    return run


def load_wandb_group(source: str, api=None) -> list[Run]:
    """The runs of a W&B group, `wandb:ENTITY/PROJECT/GROUP` (needs a login and network): their
    config (with the run's `meta`, as the tracker logged it), summary and full history. Pareto
    tables and grids are read from run stores only."""
    try:
        entity, project, group = source[len("wandb:") :].split("/", 2)
    except ValueError as e:
        raise ConfigError(f"report: {source!r} is not wandb:ENTITY/PROJECT/GROUP") from e
    runs = []
    for r in group_runs(entity, project, group, api):
        config = dict(r.config)
        meta = config.pop("meta", {}) or {}
        runs.append(
            Run(r.name, Path(f"wandb:{entity}/{project}/{r.id}"), flatten(config), meta, r.summary, by_step(r.history))
        )
    if not runs:
        raise ConfigError(f"report: W&B group {group!r} of {entity}/{project} has no runs")
    return runs


def job_order(run: Run):
    """A multirun's jobs in the order Hydra numbered them (the first value listed first)."""
    job = run.root.parent.name
    return (0, int(job), "") if job.isdigit() else (1, 0, str(run.root))


def load_runs(source: str, api=None, skipped: Optional[list[str]] = None) -> list[Run]:
    """Runs of a multirun/sweep folder, a glob of run stores, or `wandb:ENTITY/PROJECT/GROUP`,
    in job order. A run store with a file that cannot be read raises a ConfigError naming it; or,
    given `skipped`, is left out with that line appended there (unless every one is broken)."""
    if source.startswith("wandb:"):
        runs = load_wandb_group(source, api)
    else:
        runs, broken = [], []
        for store in find_stores(source):
            try:
                runs.append(load_run(store))
            except ConfigError as e:
                if skipped is None:
                    raise
                broken.append(str(e))
        if broken and not runs:
            raise ConfigError(
                f"report: every run store under {source!r} is unreadable ({len(broken)}); the first: {broken[0]}"
            )
        if skipped is not None:
            skipped += broken
    runs.sort(key=job_order)
    assign_variants(runs)
    if not source.startswith("wandb:"):  # a W&B run keeps its own name
        for r in runs:  # the job, then what sets it apart: not the overrides every job shares
            r.name = f"{r.root.parent.name}: {r.variant}, seed {r.seed}"
    return runs


def differing_fields(runs: list[Run], exclude=()) -> list[str]:
    keys = sorted(set().union(*(r.config for r in runs)))
    out = []
    for k in keys:
        if any(k == e or (e.endswith(".") and k.startswith(e)) for e in exclude):
            continue
        values = {repr(r.config.get(k)) for r in runs}
        if len(values) > 1:
            out.append(k)
    return out


def assign_variants(runs: list[Run]) -> None:
    """A variant is what differs between runs apart from the seed. Its label is what the user
    typed (`model=deepnet`, from the runs' overrides) where those tell the same variants apart
    as the configs do; else the config fields that differ (`model.layout=deepnet ...`)."""
    fields = differing_fields(runs, NOT_A_VARIANT)
    by_config = [" ".join(f"{k}={_short(r.config.get(k))}" for k in fields) or "all runs" for r in runs]
    labels = by_config
    if all("overrides" in r.meta for r in runs):
        typed = variant_labels([list(r.meta["overrides"]) for r in runs], NOT_A_VARIANT)
        same = {(a, b) for a, b in zip(typed, by_config)}
        if len({a for a, _ in same}) == len(same) == len({b for _, b in same}):  # one-to-one: the same partition
            labels = typed
    for r, label in zip(runs, labels):
        r.variant = label


def _short(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def series(run: Run, column: str, x: str = "step") -> tuple[np.ndarray, np.ndarray]:
    if column not in run.metrics or x not in run.metrics:
        return np.zeros(0), np.zeros(0)
    f = run.metrics[[x, column]].dropna()
    return f[x].to_numpy(float), f[column].to_numpy(float)


def final_value(run: Run, column: str) -> float:
    _, v = series(run, column)
    return float(v[-1]) if len(v) else math.nan
