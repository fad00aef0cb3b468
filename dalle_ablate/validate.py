"""A run config from the command line's overrides: composed with every option loaded, typed, and
checked before anything is built. The run-level checks are here (numeric ranges in one table,
fields that span sections); each option of a group checks itself (its class's RANGES and
`validate`, through its registry), and so does the `eval` section (`EvalConfig`, with the
settings of each evaluator chosen). Every failure is a ConfigError naming the field and what
would be valid; `format_error` turns Hydra's and OmegaConf's composition errors (an unknown option
or field, a bad value, an override it cannot parse) into such one line too."""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Optional

from omegaconf import DictConfig, OmegaConf

# Importing these registers every option's schema in Hydra's ConfigStore before anything composes.
from dalle_ablate.config import GRAD_SCALING, MEMBER_IMPLS, OBJECTIVES, RunConfig
from dalle_ablate.data import DATASETS
from dalle_ablate.evaluate import EvalConfig  # noqa: F401 (the eval schema)
from dalle_ablate.fileio import local_dir, looks_like_url
from dalle_ablate.model import FAMILIES
from dalle_ablate.optim import OPTIMIZERS, SCHEDULES
from dalle_ablate.registry import ConfigError, check, check_ranges
from dalle_ablate.track import TRACKERS

# Valid ranges of the run's own numeric fields ("or null": the field is optional).
RANGES = {
    "seed": "[0, inf)",
    "data_seed": "[0, inf) or null",
    "init_seed": "[0, inf) or null",
    "trainer.eval_batches": "[1, inf) or null",
    "trainer.keep_checkpoints": "[1, inf)",
    "samples.top_k": "[1, inf) or null",
    "trainer.grad_scale_init": "[5.96e-08, 16777216]",  # 2^-24 .. 2^24, the range a scale moves in
    "trainer.grad_scale_growth_every": "[1, inf)",
    "compilation_cache.min_compile_time_s": "[0, inf)",
    "compilation_cache.max_size_gb": "(0, inf) or null",
}

# (registry, section) of each option group: the section's option validates itself.
OPTION_GROUPS = (
    (FAMILIES, "model"),
    (OPTIMIZERS, "optim"),
    (SCHEDULES, "schedule"),
    (DATASETS, "data"),
    (TRACKERS, "tracker"),
)


def validate(cfg: RunConfig) -> None:
    t = cfg.trainer
    # The trainer's own counts first: the options' checks (a warm-up shorter than the run) read them.
    for name in ("steps", "batch_size", "grad_accum", "log_every", "eval_every", "save_every", "steps_per_dispatch"):
        check(getattr(t, name) > 0, f"trainer.{name}={getattr(t, name)} must be positive")
    for registry, section in OPTION_GROUPS:
        registry.validate(getattr(cfg, section), cfg)
    check_ranges(cfg, RANGES)
    check(
        t.batch_size % t.grad_accum == 0,
        f"trainer.batch_size={t.batch_size} is not divisible by trainer.grad_accum={t.grad_accum}",
    )
    check(
        t.grad_scaling in GRAD_SCALING,
        f"trainer.grad_scaling={t.grad_scaling!r} is not valid; valid: {', '.join(GRAD_SCALING)}",
    )
    # Scaling keeps float16's narrow exponent range from flushing gradients to 0; float32 and
    # bfloat16 have float32's range and need none (a scale would only cost skipped steps).
    check(
        t.grad_scaling == "none" or cfg.model.dtype == "float16",
        f"trainer.grad_scaling={t.grad_scaling} conflicts with model.dtype={cfg.model.dtype}: gradient scaling is for "
        "float16 (set model.dtype=float16, or trainer.grad_scaling=none)",
    )
    bad = [o for o in cfg.objectives if o not in OBJECTIVES]
    check(
        bool(cfg.objectives) and not bad,
        f"objectives={list(cfg.objectives)}: {bad or 'empty'}; valid: {', '.join(OBJECTIVES)}",
    )
    cfg.eval.check_all(cfg, "eval")
    check(cfg.samples.per_caption > 0, f"samples.per_caption={cfg.samples.per_caption} must be positive")
    check(cfg.samples.temperature > 0, f"samples.temperature={cfg.samples.temperature} must be positive")
    check_distributed(cfg.distributed)
    check_members(cfg)


def check_members(cfg: RunConfig) -> None:
    """Seeds as members of one job (train/program.py): what v1 of it runs, each refusal naming the
    field. Members share one program, so whatever makes a run's program depend on its process
    (several processes, PowerSGD's per-worker shard_map) is out."""
    seeds, m = cfg.seeds, cfg.mesh.member
    if seeds is None:
        check(m == 1, f"mesh.member={m} spreads the members of seeds=[...] over devices; without seeds it must be 1")
        return
    check(len(seeds) > 0, "seeds=[] lists no seed; give at least one (seeds=[0,1,2]), or leave seeds unset for one run")
    check(len(set(seeds)) == len(seeds), f"seeds={list(seeds)} repeats a seed; each member must be a different run")
    check(all(s >= 0 for s in seeds), f"seeds={list(seeds)}: every seed must be >= 0")
    check(
        cfg.members.impl in MEMBER_IMPLS,
        f"members.impl={cfg.members.impl!r} is not valid; valid: {', '.join(MEMBER_IMPLS)}",
    )
    check(
        m >= 1 and len(seeds) % m == 0,
        f"mesh.member={m} must be a positive divisor of the {len(seeds)} members of seeds={list(seeds)}",
    )
    check(
        cfg.optim.powersgd.rank is None,
        "seeds=[...] with optim.powersgd.rank: PowerSGD's per-worker compression does not run as members; "
        "run its seeds as separate runs (seed=0,1,2)",
    )
    check(
        not (cfg.distributed.coordinator_address or cfg.distributed.auto or (cfg.distributed.num_processes or 1) > 1),
        "seeds=[...] runs in one process; a run of several processes (distributed.*) trains its seeds as separate runs",
    )


def check_distributed(d) -> None:
    """Several processes need a coordinator (or a cluster JAX detects): without one each would run
    alone, and all of them would write one run folder."""
    if d.coordinator_address or d.auto:
        return
    for name in ("num_processes", "process_id"):
        value = getattr(d, name)
        check(
            value is None or (name == "num_processes" and value == 1),
            f"distributed.{name}={value} needs distributed.coordinator_address (host:port of process 0, or "
            "JAX_COORDINATOR_ADDRESS), or distributed.auto=true on a cluster JAX detects (Cloud TPU, Slurm, Open MPI)",
        )


def check_known_keys(node: DictConfig, path: str = "") -> None:
    """Hydra's `+key=value` adds a key even to a structured config: refuse one its schema (the
    dataclass of its section) has no field for. A `dict` field (a sampler's kwargs) takes any key."""
    schema = OmegaConf.get_type(node)
    fields = {f.name for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else None
    for key, child in node.items_ex(resolve=False):
        full = f"{path}.{key}" if path else str(key)
        if fields is not None and key not in fields:
            raise ConfigError(
                f"unknown field {full!r}; valid fields of {path or 'the config'}: {', '.join(sorted(fields))}"
            )
        if isinstance(child, DictConfig):
            check_known_keys(child, full)


def to_run_config(cfg: DictConfig | RunConfig) -> RunConfig:
    """The typed, validated config. Raises ConfigError naming the field and the valid values. A
    `data.cache_dir` in a bucket (gs://) becomes its staging folder, pulled once per process."""
    if isinstance(cfg, RunConfig):
        run = cfg
    else:
        missing = sorted(OmegaConf.missing_keys(cfg))
        if missing:
            raise ConfigError(
                f"missing value for {', '.join(missing)} (set it on the command line, e.g. {missing[0]}=...)"
            )
        check_known_keys(cfg)
        run = OmegaConf.to_object(cfg)
    validate(run)
    if looks_like_url(
        run.data.cache_dir
    ):  # caches in a bucket (tokenizers, codebooks, scorers): read and added to through
        run.data.cache_dir = str(local_dir(run.data.cache_dir, "data.cache_dir"))  # its staging folder (fileio)
    return run


def compose(overrides: list[str]) -> DictConfig:
    """The config for these overrides, composed as `python run.py` would (from the package's
    `conf/`, so the same from a wheel as from a checkout); `to_run_config` types and checks it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    with initialize_config_module(config_module="dalle_ablate.conf", version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides)


def format_error(ex: BaseException) -> Optional[str]:
    """One line for a user mistake, or None for an unexpected error."""
    from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    if isinstance(ex, ConfigError):
        return str(ex)
    if isinstance(ex, MissingConfigException):
        group = os.path.dirname(ex.missing_cfg_file or "") or "config"
        name = os.path.basename(ex.missing_cfg_file or "")
        options = ", ".join(sorted(ex.options or []))
        return f"{group}={name} is not a known option of '{group}'; valid: {options}"
    if isinstance(ex, OverrideParseException):
        return f"cannot parse override: {str(ex).splitlines()[0]}"
    cause = ex.__cause__ if isinstance(ex, ConfigCompositionException) else ex
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and getattr(cause, "full_key", None):
        key = cause.full_key
        obj = getattr(cause, "object_type", None)
        fields = sorted(f.name for f in dataclasses.fields(obj)) if dataclasses.is_dataclass(obj) else []
        parent = key.rsplit(".", 1)[0] if "." in key else "the config"
        return f"unknown field {key!r}; valid fields of {parent}: {', '.join(fields)}"
    if isinstance(cause, ValidationError):
        return f"bad value for {cause.full_key!r}: {str(cause).splitlines()[0]}"
    if isinstance(ex, ConfigCompositionException):
        foreign = re.search(r"In '(\S+)': ConfigKeyError.*\nKey '(\w+)' not in '(\w+)'\n\s*full_key: model\.", str(ex))
        if foreign:  # a preset of one model family composed with another's (size=dalle12b model=preln)
            return (
                f"{foreign[1]} sets model.{foreign[2]}, which the chosen model preset's {foreign[3]} has no field for; "
                f"it belongs with {family_presets(foreign[2])}"
            )
        lines = [line.strip() for line in str(ex).splitlines() if line.strip()]
        twice = re.fullmatch(r"Multiple values for (\S+)\. To override a value use 'override \1: (.+)'", lines[0])
        if twice:  # `+sweeps=x`: the group is already in the defaults list, and Hydra's hint is for YAML files
            return f"{twice[1]} is already in the defaults list: choose it with {twice[1]}={twice[2]}, without the '+'"
        unknown = re.fullmatch(
            r"In '(\S+)': ConfigKeyError raised while composing config:\nKey '\w+' not in '(\w+)'\n"
            r"\s*full_key: (\S+)\n.*",
            str(ex),
            re.S,
        )
        if unknown:  # a preset setting a field the chosen schema lacks (data=parquet experiment=quick)
            option = unknown[1].replace("/", "=", 1) if "/" in unknown[1] else unknown[1]
            return f"{option} sets {unknown[3]}, which {unknown[2]} has no field for"
        ambiguous = re.fullmatch(r"Ambiguous value for argument '([^=']+)=(.*)'", lines[0])
        if ambiguous:  # Hydra's hint, with the key and value filled in and quoted for a shell
            key, value = ambiguous[1], ambiguous[2]
            return (
                f"{key}={value} is ambiguous: for a list write {key}=[{value}]; for a string quote the value: "
                f"\"{key}='{value}'\"; to sweep over it add --multirun"
            )
        # Hydra's hints follow its first line: keep them, one sentence after another.
        return "".join(
            line if i == 0 else (" " if lines[i - 1].endswith((".", ":")) else "; ") + line
            for i, line in enumerate(lines)
        )
    return None


def family_presets(field: str) -> str:
    """The model presets (conf/model/*.yaml) whose family's config has `field`, as `model=a, model=b`."""
    from importlib.resources import files

    families = [n for n in FAMILIES.names() if field in {f.name for f in dataclasses.fields(FAMILIES.schema(n))}]
    presets = sorted(
        p.name.removesuffix(".yaml")
        for p in files("dalle_ablate.conf").joinpath("model").iterdir()
        if p.name.endswith(".yaml") and any(f"/schema/model_{f}@" in p.read_text() for f in families)
    )
    return ", ".join(f"model={p}" for p in presets) or "no model preset"
