"""Runs named by the overrides that made them: a job's W&B name and job type (job.py) and a
report's variant labels (report/load.py) read the same way, as the user typed them."""

from __future__ import annotations

# Overrides that never name a run: how it resumes, the sweeper's link to its trial, Hydra's own.
BOOKKEEPING = ("resume=", "optuna.", "hydra.")
# The seeds (config.py): runs that differ only in these are replicates of one variant.
SEEDS = ("seed", "data_seed", "init_seed")
# What names a study's run (one with an `+arm=` override) whatever its multirun varies: its arm and
# its seed. A study's jobs vary one of them (a members job of one arm: the seed; the timed arms'
# job of one seed: the arm), and its runs of all arms and seeds share its group.
STUDY_RUN = ("arm", "seed")


def key_of(override: str) -> str:
    return override.partition("=")[0].lstrip("+~")


def short(override: str) -> str:
    """`key=value` with a float value to 3 significant digits (a sampled rate has 17)."""
    key, _, value = override.partition("=")
    try:
        int(value)
        return override
    except ValueError:
        pass
    try:
        return f"{key}={float(value):.3g}"
    except ValueError:
        return override


def own(overrides: list[str]) -> list[str]:
    return [o for o in overrides if not o.startswith(BOOKKEEPING)]


def run_naming(overrides: list[str], varying: set[str], layout: str) -> tuple[str, str]:
    """(W&B name, job type) of a job: the name is what the job's overrides set among the keys
    its multirun varies, seeds included (all its overrides for a single run); the job type is the
    same less the seeds (SEEDS), so that the seeds of one variant share it (the layout when nothing
    else varies). A study's run is named by its arm and seed (STUDY_RUN) in every multirun."""
    mine = own(overrides)
    if varying and any(key_of(o) == "arm" for o in mine):
        varying = set(varying) | set(STUDY_RUN)
    named = [short(o) for o in mine if key_of(o) in varying] if varying else [short(o) for o in mine]
    variant = [o for o in named if key_of(o) not in SEEDS] if varying else []
    return ",".join(named) or "run", ",".join(variant) or layout


def variant_labels(override_lists: list[list[str]], ignore: tuple[str, ...]) -> list[str]:
    """A label per run: its overrides whose key differs between the runs (set to different values,
    or set in some runs only), less the keys in `ignore` (exact, or a prefix ending in '.')."""
    lists = [{key_of(o): short(o) for o in own(lst)} for lst in override_lists]
    keys = list(dict.fromkeys(k for lst in lists for k in lst))
    skip = lambda k: any(k == e or (e.endswith(".") and k.startswith(e)) for e in ignore)  # noqa: E731
    varying = [k for k in keys if not skip(k) and len({lst.get(k) for lst in lists}) > 1]
    return [" ".join(lst[k] for k in varying if k in lst) or "all runs" for lst in lists]
