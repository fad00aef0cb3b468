"""The run-level configuration: Hydra structured configs registered in the ConfigStore.

Every YAML file in `dalle_ablate/conf/<group>/` starts from a schema (`/schema/<name>@_here_`), so
a typo in a field name fails when Hydra composes the config, before anything is built. The
sections below are the run's own; each option of the `model`, `optim`, `schedule`, `data` and
`tracker` groups has its config dataclass in its own module, beside its builder, registered by
`Registry.option` (docs/architecture.md, "Adding an option"); the `eval` section, with the
settings of its evaluators, is `evaluate.EvalConfig`. `validate.py` composes, types and checks the
whole.
"""

from __future__ import annotations

import dataclasses
import textwrap
from dataclasses import dataclass, field
from importlib.resources import files
from typing import Any, Optional

import yaml
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf


# The project's cache folder: rendered data, fitted tokenizers and scorers (`data.cache_dir`), and
# compiled programs (`compilation_cache.dir`), each in a folder of its own under it.
CACHE_ROOT = "${oc.env:DALLE_ABLATE_CACHE,${oc.env:HOME,.}/.cache/dalle-ablate}"


@dataclass
class TrainerConfig:
    steps: int = 2000  # optimizer updates the run trains for (a resumed run continues up to it)
    batch_size: int = 32  # examples per optimizer step, all micro-batches together
    grad_accum: int = 1  # micro-batches per step
    log_every: int = 50  # per-layer norms, optimizer stats
    eval_every: int = 500  # steps between validation losses (a sweep's pruner asks then); also at the last step
    eval_batches: Optional[int] = None  # null = the whole valid split
    save_every: int = 1000  # steps between checkpoints (run/checkpoints/<step>); also at the last step
    keep_checkpoints: int = 2  # checkpoints kept on disk, the newest; orbax deletes older ones after each save
    progress: bool = True  # the progress bar (steps, loss, tokens/s) on process 0; false for logs and CI
    # Steps compiled into one program (lax.scan), the host returning between them only: the same
    # numbers, and on this project's 2-core CPU 1.14x the study's step at 5
    # (docs/results/benchmarks/step-levers.md). Hooks still fall on their steps; Ctrl-C waits for the dispatch.
    steps_per_dispatch: int = 1
    # float16 gradient scaling (train/grad_scaling.py): none | global (one dynamic loss scale) |
    # per_block (DALL·E's per-resblock scales); a step with an Inf or NaN gradient is skipped.
    grad_scaling: str = "none"
    grad_scale_init: float = 32768.0  # 2^15
    grad_scale_growth_every: int = 500  # a scale doubles after this many steps without overflow


@dataclass
class MeshConfig:
    """Device mesh (dalle_ablate/parallel): sizes of its three axes; -1 = the remaining devices."""

    data: int = -1  # batch split, parameters replicated
    fsdp: int = 1  # batch split, parameters and optimizer state sharded on their embed axis
    model: int = 1  # tensor parallel: heads, MLP and vocabulary split
    # Members of one job (`seeds=[...]`) spread over this many device groups; each member's own
    # run uses the data x fsdp x model mesh inside its group (train/program.py). 1 without `seeds`.
    member: int = 1


@dataclass
class DistributedConfig:
    """Several processes (hosts) in one run: jax.distributed.initialize before anything else.
    conf/config.yaml fills the fields from JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and
    JAX_PROCESS_ID when they are set."""

    coordinator_address: Optional[str] = None  # host:port of process 0; null = a single process
    num_processes: Optional[int] = None  # processes (hosts) in the run; null = 1, or what the cluster says
    process_id: Optional[int] = None  # this process's rank, 0 .. num_processes - 1
    auto: bool = False  # initialize() with no arguments: Cloud TPU, Slurm and Open MPI detect themselves


@dataclass
class CompilationCacheConfig:
    """JAX's persistent compilation cache (parallel/compile_cache.py): the programs a run compiles,
    kept on disk for the next run that compiles the same ones (JAX's key: the program, its devices,
    the XLA flags and the jax version). Per machine, like the devices it compiles for."""

    # the cache's folder (JAX_COMPILATION_CACHE_DIR when set); null = off: every run compiles its own
    dir: Optional[str] = "${oc.env:JAX_COMPILATION_CACHE_DIR," + CACHE_ROOT + "/jax-compilation}"
    # a program that compiled faster than this is not kept (JAX's own default is 1 s, more than the tiny model's take)
    min_compile_time_s: float = 0.0
    # null = no bound (JAX's default). A bound removes the least recently used programs past it, and
    # makes JAX lock the folder around each read and write -- and rescan the whole folder at every
    # write, 0.1 s per 1000 entries here (docs/guides/runs.md), which is why it is not the default
    max_size_gb: Optional[float] = None


@dataclass
class SamplesConfig:
    """Images generated at the end of a run for a few fixed captions."""

    captions: Optional[list[str]] = None  # null = the dataset's fixed demo captions
    per_caption: int = 4  # images drawn for each caption (a row of the grid)
    temperature: float = 0.5  # as eval=default samples: drawn right more often (docs/results/default-job.md)
    top_k: Optional[int] = None  # sample among the k likeliest codes only; null = all


@dataclass
class MembersConfig:
    """How the seeds of `seeds=[...]` run as members of one compiled job (train/program.py,
    docs/guides/members.md)."""

    # vmap: one batched program (the members' matmuls fused; equal to separate runs within float32
    # rounding). map: `lax.map` over the members, each member's own unbatched program in one
    # compiled loop (bit-for-bit the separate runs on a CPU; no faster than them on an accelerator).
    impl: str = "vmap"


MEMBER_IMPLS = ("vmap", "map")
# The settings of a members job that its members' own runs never have (each is the run `seed=k`):
# how runs were made, never what they compare (keys, or prefixes ending in '.').
MEMBER_ONLY = ("seeds", "members.", "mesh.member")


def member_only(key: str) -> bool:
    """Whether an override's key sets one of MEMBER_ONLY (`members` alone sets them all)."""
    return any(key == e.rstrip(".") or (e.endswith(".") and key.startswith(e)) for e in MEMBER_ONLY)


GRAD_SCALING = ("none", "global", "per_block")  # trainer.grad_scaling (train/grad_scaling.py)

# Values of a run's summary a job can return to a sweeper (RunConfig.objectives).
OBJECTIVES = ("eval/valid/loss", "train/loss", "train/first_loss", "wall_time", "steps")


@dataclass
class OptunaTrialConfig:
    """Set by the Optuna sweeper (hydra/sweeper=optuna), never by hand: which study and trial this
    job runs for, so the trainer can report eval losses to it and be pruned."""

    storage: Optional[str] = None  # the study's storage URL (sqlite:///... or postgresql://...)
    study: Optional[str] = None  # the study's name in that storage
    trial: Optional[int] = None  # the trial's number in the study
    statistic: str = "mean"  # a trial of several seeds: its value over its members (hydra.sweeper.statistic)


@dataclass
class RunConfig:
    # Options, each typed by the schema its preset starts from (model.ModelConfig, optim.OptimConfig,
    # optim.ScheduleConfig, data.DataConfig, track.TrackerConfig and their subclasses), and the
    # evaluation (evaluate.EvalConfig, which holds its evaluators' settings).
    model: Any = MISSING
    optim: Any = MISSING
    schedule: Any = MISSING
    data: Any = MISSING
    tracker: Any = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)  # the loop: steps, batch, what runs how often
    samples: SamplesConfig = field(default_factory=SamplesConfig)  # the sample grid drawn at the end of a run
    eval: Any = MISSING
    mesh: MeshConfig = field(default_factory=MeshConfig)  # how devices split the batch and the parameters
    distributed: DistributedConfig = field(default_factory=DistributedConfig)  # several processes (hosts) in one run
    # compiled programs kept on disk for the next run (set `compilation_cache.dir=null` to turn it off)
    compilation_cache: CompilationCacheConfig = field(default_factory=CompilationCacheConfig)
    # The run's randomness. `seed` sets everything; two of its sources can be set apart, so that a
    # study can vary one at a time and say how much of its seed-to-seed spread each one causes
    # (Bouthillier et al. 2021, "Accounting for variance in machine learning benchmarks"). null =
    # `seed`. The dropout masks and the end-of-run sample grid's noise follow `seed` alone.
    seed: int = 0
    data_seed: Optional[int] = None  # the order of the training examples and which captions are blanked
    init_seed: Optional[int] = None  # the initial parameters (each keyed by its path, model/init_keys.py)
    # Train these seeds as members of one job, each exactly the run `seed=k` would be (its own
    # initial key, data order, run store, W&B run, checkpoints): one program and one start-up for
    # all of them (train/loop.py). A list is one value, not a sweep: `-m +arm=a,b seeds=[0,1,2]`
    # is 2 jobs of 3 members each; `seed=0,1,2` stays 3 separate jobs.
    seeds: Optional[list[int]] = None
    members: MembersConfig = field(default_factory=MembersConfig)  # how the members of seeds=[...] run
    resume: Optional[str] = None  # null | auto | a run dir or checkpoint dir
    # What the job returns to a sweeper: one value, or a list for a multi-objective sweep; names
    # of the run's summary (OBJECTIVES above).
    objectives: list[str] = field(default_factory=lambda: ["eval/valid/loss"])
    optuna: OptunaTrialConfig = field(default_factory=OptunaTrialConfig)  # set by the Optuna sweeper, never by hand


def data_seed(cfg: RunConfig) -> int:
    """The seed of the training data's order (and its blanked captions): `data_seed`, else `seed`."""
    return cfg.seed if cfg.data_seed is None else cfg.data_seed


def init_seed(cfg: RunConfig) -> int:
    """The seed of the initial parameters: `init_seed`, else `seed`."""
    return cfg.seed if cfg.init_seed is None else cfg.init_seed


def member_config(cfg: RunConfig, seed: int) -> RunConfig:
    """The config of member `seed` of a members job: the separate run `seed=k` (MEMBER_ONLY unset)."""
    return dataclasses.replace(
        cfg,
        seed=seed,
        seeds=None,
        members=MembersConfig(),
        mesh=dataclasses.replace(cfg.mesh, member=MeshConfig().member),
    )


def member_record(record: dict, cfg: RunConfig, seed: int) -> dict:
    """The resolved config the separate run `seed=k` records: a members job's own `record` (its
    config as Hydra composed it; `cfg`, the same typed) with what `member_config` changes in it."""

    def changed(out: dict, before: dict, after: dict) -> dict:
        out = dict(out)
        for k, v in after.items():
            if isinstance(v, dict) and isinstance(before.get(k), dict) and isinstance(out.get(k), dict):
                out[k] = changed(out[k], before[k], v)
            elif before.get(k) != v:
                out[k] = v
        return out

    return changed(record, dataclasses.asdict(cfg), dataclasses.asdict(member_config(cfg, seed)))


# The groups a user chooses with `group=option` (dalle_ablate/conf/<group>/), in the order a reader
# meets them, and what each picks: `python run.py --help` lists them (`help_groups`) and so does the
# configuration reference (docs.py). `schema` (each option's dataclass) is the presets' own.
GROUPS = {
    "experiment": "a whole ablation: a sweep over arms and seeds, with the settings it runs at",
    "arm": "one variant of a study (`+arm=NAME`): the overrides that make it differ from the baseline",
    "model": "the layout (block structure) and its flags; the family (seq2seq or single_stream)",
    "size": "the model's dimensions (`size=tiny`, ... `dalle12b`)",
    "optim": "the optimizer and its hyperparameters",
    "schedule": "the learning-rate schedule",
    "data": "the dataset, its tokenizers and loader",
    "eval": "what the evaluation measures and draws",
    "mesh": "how devices split the batch and the parameters",
    "tracker": "where metrics go (none or W&B)",
    "sweeps": "Optuna searches (`sweeps=NAME`)",
}


def group_options(group: str) -> list[str]:
    """The presets of a config group: its YAML files in dalle_ablate/conf/<group>/."""
    return sorted(
        p.name.removesuffix(".yaml")
        for p in files("dalle_ablate.conf").joinpath(group).iterdir()
        if p.name.endswith(".yaml")
    )


def help_groups(width: int = 100) -> str:
    """The config groups for `python run.py --help` (`${dalle_ablate.groups:}` in conf/config.yaml's
    hydra.help.template): `group=` (`+group=` where the defaults list has none) and what it picks,
    then its options, indented."""
    listed = {
        next(iter(d)).split()[-1] if isinstance(d, dict) else d
        for d in yaml.safe_load(files("dalle_ablate.conf").joinpath("config.yaml").read_text())["defaults"]
    }
    lines = []
    for group, what in GROUPS.items():
        lines.append(f"  {'' if group in listed else '+'}{group}=".ljust(15) + what.replace("`", ""))
        lines += textwrap.wrap(
            ", ".join(group_options(group)), width, initial_indent=" " * 15, subsequent_indent=" " * 15
        )
    return "\n".join(lines)


def register_configs() -> None:
    """Schemas live in the `schema` group, so that `model=glob(*)` and the option lists in error
    messages see only the YAML options; each YAML starts from one with `/schema/<name>@_here_`."""
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=RunConfig)
    cs.store(group="schema", name="mesh", node=MeshConfig)
    if not OmegaConf.has_resolver("dalle_ablate.groups"):
        OmegaConf.register_new_resolver("dalle_ablate.groups", help_groups)


register_configs()
