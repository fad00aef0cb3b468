"""The Hydra task function (`run.py`): from the composed config to a training run, and, when the
Optuna sweeper launched the job, the bridge to its trial -- the trainer itself knows nothing of
Optuna: it calls `RunHooks` and reports "pruned", which this module turns into the
`optuna.TrialPruned` the sweeper records."""

from __future__ import annotations

import logging
import shlex
from pathlib import Path

import hydra
import jax
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from dalle_ablate.cli import run_hydra
from dalle_ablate.parallel import distributed
from dalle_ablate.registry import Interrupted, RunFailed
from dalle_ablate.track.naming import run_naming
from dalle_ablate.train.loop import JobInfo, RunHooks, finished_before, train
from dalle_ablate.train.tokenizer import closing_lines as tokenizer_lines, tokenizer_cached, train_tokenizer
from dalle_ablate.validate import to_run_config


def varying_keys(sweep_dir: Path) -> set[str]:
    """The keys a multirun or sweep varies, from the `multirun.yaml` its sweeper saved: the sweep
    overrides of its command line (`a,b`, `choice`, `range`, `interval`) and its sweeper's params."""
    path = sweep_dir / "multirun.yaml"
    if not path.exists():
        return set()
    from hydra.core.override_parser.overrides_parser import OverridesParser

    saved = OmegaConf.load(path).hydra
    params = saved.sweeper.get("params") or {}
    texts = [*saved.overrides.task, *(f"{k}={v}" for k, v in params.items())]
    return {o.key_or_group for o in OverridesParser.create().parse_overrides(texts) if o.is_sweep_override()}


def job_info(cfg: DictConfig) -> JobInfo:
    hc = HydraConfig.get()
    overrides = list(hc.overrides.task)
    multirun = hc.mode == RunMode.MULTIRUN
    name, job_type = run_naming(overrides, varying_keys(Path(hc.sweep.dir)) if multirun else set(), cfg.model.layout)
    return JobInfo(
        job_dir=Path(hc.runtime.output_dir),
        # W&B: group = the multirun (or sweep) folder, name = what this job varies.
        group=hc.sweep.dir if multirun else None,
        name=name,
        job_type=job_type,
        overrides=overrides,
        config=OmegaConf.to_container(cfg, resolve=True),
    )


class TrialHooks(RunHooks):
    """A job launched by the Optuna sweeper (`optuna.*` set): its run store recorded on the trial
    at the start, and the study's pruner asked after each evaluation -- in a single-process run
    only, since other processes could not agree with process 0 on when to stop."""

    def __init__(self, link):
        self.link = link
        self.pruning = None

    def started(self, run_dir: Path, processes: int) -> None:
        from dalle_ablate.sweep.trial import pruning_for, record_run_dir

        record_run_dir(self.link, run_dir)
        if processes == 1:
            self.pruning = pruning_for(self.link)

    def should_stop(self, eval_loss: float, step: int) -> bool:
        return self.pruning is not None and self.pruning.report(eval_loss, step)


def tokenizer_first(run_cfg, job: JobInfo) -> None:
    """Stage 1: the built-in data's image tokenizer (e.g. data.tokenizer=dvae) fitted before the
    run, on process 0, in a run store and tracker run of its own (`<job>/tokenizer`) -- unless it
    is cached, or the run finished before (resume=auto leaves it as it is)."""
    distributed.initialize(run_cfg.distributed)  # process 0 alone fits it
    if (run_cfg.data.name != "shapes" or jax.process_index() != 0 or tokenizer_cached(run_cfg.data)
            or finished_before(run_cfg, Path(job.job_dir) / "run") is not None):
        return
    res = train_tokenizer(run_cfg, Path(job.job_dir) / "tokenizer", name=f"{job.name} tokenizer" if job.name else None,
                          group=job.group, overrides=job.overrides)
    print(tokenizer_lines(run_cfg, res), flush=True)


def run(cfg: DictConfig) -> float | list[float]:
    # Hydra logs at INFO; JAX's note that no TPU/GPU backend was found would bury the progress
    # bar. orbax logs through absl: its per-save chatter, and a failed save once per thread with a
    # traceback, which the Checkpointer reports in one line instead (train/checkpoint.py).
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
    logging.getLogger("absl").setLevel(logging.CRITICAL)
    run_cfg = to_run_config(cfg)
    job = job_info(cfg)
    if run_cfg.optuna.trial is not None:
        job.hooks = TrialHooks(run_cfg.optuna)
    tokenizer_first(run_cfg, job)
    result = train(run_cfg, job)
    if result.status == "diverged":
        # Not a value: the process exits non-zero (cli.run_hydra), a sweep records a FAILED trial.
        raise RunFailed(f"{job.name}: {result.reason} (run store {result.run_dir})", RunFailed.DIVERGED)
    if result.status == "interrupted":
        kept = [o for o in job.overrides if not o.startswith(("resume=", "optuna."))]  # resumed as a run of its own
        again = " ".join(shlex.quote(o) for o in [*kept, "resume=auto", f"hydra.run.dir={job.job_dir}"])
        raise Interrupted(f"{result.reason}; checkpoint saved; resume with: python run.py {again}")
    if result.status == "pruned":
        import optuna

        raise optuna.TrialPruned(result.reason)
    values = [float(result.summary[k]) for k in run_cfg.objectives]
    return values[0] if len(values) == 1 else values


class ReportHint(Callback):
    """At the end of a multirun or sweep (conf/config.yaml `hydra.callbacks`): its folder, and the
    command that compares its runs."""

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        folder = config.hydra.sweep.dir
        print(f"multirun finished: {folder}; compare its runs with: dalle-ablate report {shlex.quote(str(folder))}")


# The configs are the package's own (dalle_ablate/conf), found beside this module from a checkout
# and from an installed wheel alike.
main = hydra.main(version_base="1.3", config_path="conf", config_name="config")(run)

if __name__ == "__main__":
    run_hydra(main)
