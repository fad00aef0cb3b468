"""A study's record: what its page and verdicts read of each finished run, one small JSON file per
run, kept where it outlives the machine (a folder committed with the code, or a bucket), so that a
study continues from it on another machine and its page is rebuilt from it alone.

    <record>/declaration.json       the design, frozen when stage 1 starts (study/declaration.py)
    <record>/stages.json            stage 2's plan, once made (report/staged.py RECORD)
    <record>/runs/<arm>-seed<k>.json            a run of the study (stage 1 or 2)
    <record>/stress/<arm>-lr<rate>-seed<k>.json a stress run (report/stress.py)

A run's file holds its arm, seed, stage and overrides, the identity of the code that trained it
(study/identity.py), its config, the curves the page reads (every logged step of `METRICS`), its
evaluations' tables the page reads, its summary, wall time, transition step and machine. pandas
reads it without this package: `pd.DataFrame(json.load(open(f))["metrics"])` is its curves."""

from __future__ import annotations

import json
import math
import os
import re
import platform
import socket
from pathlib import Path
from typing import Optional

import numpy as np
import pandas as pd

from dalle_ablate.fileio import atomic_write, check_url, is_url, pull, shown
from dalle_ablate.registry import ConfigError
from dalle_ablate.report.load import Run, by_step, flatten, job_order, read_json, series
from dalle_ablate.report.transitions import METRIC as TRANSITION
from dalle_ablate.report.transitions import Rule, transition_step

FORMAT = 1
DECLARATION = "declaration.json"
RUNS, STRESS = "runs", "stress"
# The logged curves a study's page reads (report/findings.py, noise.py, transitions.py, figures):
# every step of each, the train steps' in `metrics` and the evaluations' in `evals` (a table each:
# the eval loss is logged at a tenth of the steps). The page built from a record and from the run
# stores are the same only if these name all of them (tests/study/test_record.py builds both).
PER_STEP = ("train/loss", "perf/step_time")
PER_EVAL = ("eval/valid/loss",)
METRICS = (*PER_STEP, *PER_EVAL)
# An evaluation's Pareto table (one row per guidance scale) as a record keeps it: its guidance scale
# and each all-correct rate with its prompt count, overall and per tier, and the FD -- the final
# metrics the page reads and a reader compares, not the ~200 columns of every rate's interval.
PARETO = re.compile(r"scale|n|step|shapes/(\w+/)?(all|n)|shapes_fd/fd")
# meta.json's parts a page or a check reads: the arm (overrides), the model's size, how the job
# trained its members (its own folder as a name: the job, not where it lay), the code, the machine.
META = ("overrides", "params", "flops_per_step", "members", "git", "versions", "device", "resumed_from_step")


# -- a run as its file -----------------------------------------------------------------------------
def entry_of(run: Run, arm: str, stage, code: dict, transition: Rule, lr: Optional[float] = None) -> dict:
    """A run store's entry: what the page reads of it (Run), the code that trained it (`code`,
    identity.code_of) and the stage it belongs to (1, 2 or "stress")."""
    meta = {k: run.meta[k] for k in META if k in run.meta}
    if meta.get("members"):  # its job's folder by name: the job, wherever it ran
        meta["members"] = {**meta["members"], "job_dir": Path(str(meta["members"].get("job_dir", ""))).name}
    steps_, values = series(run, TRANSITION)
    step = transition_step(steps_, values, transition.level, transition.confirm) if len(steps_) else None
    entry = {
        "record": FORMAT,
        "name": run.root.parent.name,
        "arm": arm,
        "seed": run.seed,
        "stage": stage,
        "lr": lr,
        "overrides": list(run.meta.get("overrides", [])),
        "code": code,
        "wall_time": run.summary.get("wall_time"),
        "transition": None if step is None else int(step),
        "machine": machine(),
        "summary": run.summary,
        "meta": meta,
        "config": unflatten(run.config),
        "metrics": _table(run, PER_STEP),
        "evals": _table(run, PER_EVAL),
        "pareto": {str(int(s)): final_columns(t) for s, t in sorted((run.pareto_steps or {}).items())},
        "valid_losses": None if run.valid_losses is None else as_float32([float(x) for x in run.valid_losses]),
    }
    entry["float32"] = float32_paths(entry)
    return entry


def _table(run: Run, columns: tuple[str, ...]) -> dict:
    """The steps at which any of `columns` was logged, and each column's values there (NaN where it
    was not): a table pandas reads as it is."""
    frame = run.metrics
    steps = frame["step"].to_numpy(int) if "step" in frame else np.zeros(0, int)
    curves = {m: frame[m].to_numpy(float) if m in frame else np.full(len(steps), np.nan) for m in columns}
    kept = np.zeros(len(steps), bool)
    for v in curves.values():
        kept |= ~np.isnan(v)
    return {"step": steps[kept].tolist(), **{m: as_float32(v[kept].tolist()) for m, v in curves.items()}}


def final_columns(table: dict) -> dict:
    """An eval_pareto table less the columns a record does not keep (PARETO)."""
    keep = [i for i, c in enumerate(table["columns"]) if PARETO.fullmatch(c)]
    return {"columns": [table["columns"][i] for i in keep], "rows": [[row[i] for i in keep] for row in table["rows"]]}


def run_of(entry: dict, path: Path) -> Run:
    """The Run a page reads, from a run's entry (its file at `path`): the same values as the run
    store gave, so that the page is the same."""
    tables = [pd.DataFrame(entry[k]).astype({"step": np.int64}) for k in ("metrics", "evals")]
    frame = by_step(pd.concat(tables, ignore_index=True).sort_values("step", kind="stable").to_dict("records"))
    meta = dict(entry["meta"])
    pareto = {float(s): t for s, t in entry.get("pareto", {}).items()}
    run = Run(entry["name"], path, flatten(entry["config"]), meta, entry["summary"], frame)
    run.pareto = pareto[max(pareto)] if pareto else None
    run.pareto_steps = pareto
    run.valid_losses = None if entry.get("valid_losses") is None else np.asarray(entry["valid_losses"], np.float64)
    return run


def unflatten(config: dict) -> dict:
    out: dict = {}
    for key, v in config.items():
        *parents, last = key.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = list(v) if isinstance(v, tuple) else v
    return out


def machine() -> dict:
    """The machine that recorded the run (the one that trained it, for a study's own runs)."""
    cpu = ""
    try:
        cpu = next(
            (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), ""
        )
    except OSError:
        pass
    return {"host": socket.gethostname(), "cpu": cpu or platform.processor(), "cores": os.cpu_count()}


# -- the file's text: deterministic, a line per field, float32 curves in float32 digits --------------
class F32(list):
    """A list of float32 values (a loss curve: the run logged float32 numbers as doubles), written
    with their shortest float32 digits -- half the text -- and read back as the same doubles."""


def float32_paths(entry: dict) -> list[str]:
    return [f"{t}/{k}" for t in ("metrics", "evals") for k, v in entry[t].items() if isinstance(v, F32)] + (
        ["valid_losses"] if isinstance(entry.get("valid_losses"), F32) else []
    )


def as_float32(values: list) -> list:
    """`values` as an F32 list where each is a float32 exactly (else as they are)."""
    finite = [x for x in values if isinstance(x, float) and math.isfinite(x)]
    exact = all(float(np.float32(x)) == x and float(np.float32(float(str(np.float32(x))))) == x for x in finite)
    return F32(values) if finite and exact else values


def dumps(entry: dict) -> str:
    """An entry as JSON text: keys sorted, one per line, each list of numbers on one line."""
    return _text(entry, 0) + "\n"


def _text(v, depth: int) -> str:
    pad = " " * (depth + 1)
    if isinstance(v, dict) and v:
        inner = ",\n".join(f"{pad}{json.dumps(str(k))}: {_text(v[k], depth + 1)}" for k in sorted(v))
        return "{\n" + inner + "\n" + " " * depth + "}"
    if isinstance(v, (list, tuple)) and any(isinstance(x, (dict, list, tuple)) for x in v):
        return "[\n" + ",\n".join(pad + _text(x, depth + 1) for x in v) + "\n" + " " * depth + "]"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_number(x, isinstance(v, F32)) for x in v) + "]"
    return _number(v, False)


def _number(x, f32: bool) -> str:
    if isinstance(x, float):
        if math.isnan(x):
            return "NaN"  # Python's json and pandas read these; a run's curve can hold them
        if math.isinf(x):
            return "Infinity" if x > 0 else "-Infinity"
        return str(np.float32(x)) if f32 else repr(x)
    return json.dumps(x)


def loads(text: str, path: Path) -> dict:
    """An entry read back (a ConfigError naming the file where it is torn or not one)."""
    try:
        entry = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"{path}: not valid JSON, half-written or corrupt ({e.msg}: line {e.lineno} column {e.colno}); "
            "delete it and the study trains that run again"
        ) from None
    if not isinstance(entry, dict) or entry.get("record") != FORMAT:
        raise ConfigError(f'{path}: not a study record\'s run (no "record": {FORMAT}); delete it or move it away')
    missing = [
        k
        for k in ("name", "arm", "seed", "stage", "overrides", "code", "summary", "meta", "config", "metrics", "evals")
        if k not in entry
    ]
    if missing:
        raise ConfigError(f"{path}: a run's entry without {', '.join(missing)}: torn or edited; delete it")
    return _restore(entry)


def _restore(entry: dict) -> dict:
    """Each float32 curve as the doubles the run logged (its digits are the float32's shortest)."""
    for path in entry.get("float32", []):
        *parents, last = path.split("/", 1) if path.startswith(("metrics/", "evals/")) else [path]
        node = entry[parents[0]] if parents else entry
        node[last] = F32(float(np.float32(x)) if isinstance(x, float) else x for x in node[last])
    return entry


# -- the record's folder -------------------------------------------------------------------------
class Record:
    """A study's record in a folder, or in a bucket (`gs://...`, through its staging copy: each file
    written there is uploaded whole, as run stores are)."""

    def __init__(self, where: str):
        self.where = where.rstrip("/")
        self.root = pull(check_url(self.where, "--record")) if is_url(where) else Path(where)
        if self.root.exists() and not self.root.is_dir():
            raise ConfigError(f"--record {where}: not a folder; give a folder (new or a record's) or a gs:// URL")

    def __str__(self) -> str:
        return shown(self.root) if is_url(self.where) else self.where

    def declaration(self) -> Optional[dict]:
        path = self.root / DECLARATION
        return read_json(path) if path.exists() else None

    def freeze(self, declared: dict) -> None:
        """Write the declaration, once: before the record holds any run."""
        self.root.mkdir(parents=True, exist_ok=True)
        atomic_write(self.root / DECLARATION, json.dumps(declared, indent=1, sort_keys=True) + "\n")

    def entries(self, kind: str) -> dict[str, dict]:
        """The entries of `kind` (RUNS or STRESS) by name, each read and checked as a file (a
        ConfigError naming a torn one; the others are left as they are)."""
        folder = self.root / kind
        out = {}
        for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
            try:
                text = path.read_text()
            except (OSError, UnicodeDecodeError) as e:
                raise ConfigError(
                    f"{path}: cannot be read ({e}); delete it and the study trains that run again"
                ) from None
            entry = loads(text, path)
            if entry["name"] != path.stem:
                raise ConfigError(
                    f"{path}: holds the run {entry['name']!r}, not {path.stem!r}: moved or edited; delete it"
                )
            out[path.stem] = entry
        return out

    def runs(self, kind: str) -> list[Run]:
        """The entries of `kind` as the Runs a page reads, in the order a study folder's stores load
        (load.job_order on the path: `<record>/<kind>/<name>.json` sorts as `<folder>/<name>/run`,
        since no character lies between '.' and '/')."""
        runs = [run_of(e, self.root / kind / f"{name}.json") for name, e in self.entries(kind).items()]
        runs.sort(key=job_order)
        return runs

    def add(self, kind: str, entry: dict) -> None:
        (self.root / kind).mkdir(parents=True, exist_ok=True)
        atomic_write(self.root / kind / f"{entry['name']}.json", dumps(entry))


# -- what goes in: finished run stores, checked against the declaration --------------------------------
def expected_overrides(declared: dict, arm: str, lr: Optional[float] = None) -> set[str]:
    """The overrides a run of `arm` records (meta.json), less those that choose its seed and how its
    job ran: the study's preset and own overrides, and a stress run's rate, budget and plan's."""
    from dalle_ablate.report.study_file import CONTROLLED
    from dalle_ablate.track.naming import key_of

    p = declared["protocol"]
    if lr is None:
        return {f"experiment={p['experiment']}", f"+arm={arm}", *p["overrides"]}
    s = declared["stress"]  # a stress run sets its rate and budget itself (stress_runs.job_command)
    own = [o for o in p["overrides"] if key_of(o) not in CONTROLLED]
    return {
        f"experiment={p['experiment']}",
        f"+arm={arm}",
        f"optim.lr={lr!r}",
        f"trainer.steps={s['steps']}",
        *s["overrides"],
        *own,
    }


def _values(overrides: list[str]) -> dict[str, str]:
    """Overrides as key -> value, each value as Hydra reads it (`false` and `False` are one value)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    return {f"{o.get_key_element()}": repr(o.value()) for o in parsed}


def _how(override: str) -> bool:
    """An override that says how a run was made or kept, not what it is (declaration.own_overrides)."""
    from dalle_ablate.study.declaration import CHOOSERS, unvarying
    from dalle_ablate.track.naming import key_of

    k = key_of(override)
    return (k in CHOOSERS and k != "arm") or k.startswith("hydra") or unvarying(k)


def check_entry(entry: dict, declared: dict, seeds: list[int], where: str) -> None:
    """Refuse, in one line naming the difference, an entry that is not a run of the declared
    study: another arm or seed, other overrides or config, other code. `where`: the entry's file,
    or the run store it is made from, as the line names it."""
    from dalle_ablate.study.declaration import config_digest

    arm, lr = entry["arm"], entry.get("lr")
    stress = entry["stage"] == "stress"
    arms = declared["protocol"]["configs"].get("stress" if stress else "runs", {})
    if arm not in arms:
        raise ConfigError(
            f"{where} is a run of arm {arm!r}, which the declaration does not run; valid: {', '.join(arms)}"
        )
    if entry["seed"] not in seeds:
        raise ConfigError(
            f"{where} has seed {entry['seed']}, not one the declaration gives it ({', '.join(map(str, seeds))})"
        )
    given = _values([o for o in entry["overrides"] if not _how(o)])
    want = _values(sorted(expected_overrides(declared, arm, lr if stress else None)))
    if given != want:
        extra = sorted(f"{k}={v}" for k, v in given.items() if want.get(k) != v)
        lacking = sorted(f"{k}={v}" for k, v in want.items() if given.get(k) != v)
        raise ConfigError(
            f"{where} was trained with other overrides than the declaration's: "
            + "; ".join(
                x
                for x in (
                    f"{', '.join(extra)} not declared" if extra else "",
                    f"{', '.join(lacking)} missing" if lacking else "",
                )
                if x
            )
        )
    digest = config_digest(flatten(entry["config"]), ("optim.lr",) if stress else ())
    if digest != arms[arm]:
        raise ConfigError(
            f"{where}: its config (digest {digest}) is not the one its overrides composed when the study was "
            f"declared ({arms[arm]}): the preset or the arm's file changed since"
        )
    code, frozen = entry["code"], declared["code"]
    if code["numbers"] != frozen["numbers"]:
        raise ConfigError(
            f"{where} was trained at {code['commit'][:12]} by other code than the declaration's (the digest of the "
            f"code that decides its numbers is {code['numbers']}, declared {frozen['numbers']}); results of other "
            "code are not mixed in"
        )
    if code["libraries"] != frozen["libraries"]:
        other = ", ".join(f"{k} {v}" for k, v in code["libraries"].items() if frozen["libraries"].get(k) != v)
        raise ConfigError(
            f"{where} was trained with other libraries than the declaration's ({other}; declared "
            + ", ".join(f"{k} {v}" for k, v in frozen["libraries"].items())
            + "); results of other code are not mixed in"
        )
