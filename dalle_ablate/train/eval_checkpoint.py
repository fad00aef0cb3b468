"""`dalle-ablate eval <run dir or checkpoint> [overrides]`: the evaluation of a saved checkpoint,
with the run's own config (the `config.yaml` its run store saved) plus what the command line's
overrides change (`run_config_for_eval`). Results go to `<run store>/evals/<eval.name>_step<step>/` (a run store of their own:
the training run's files are never rewritten) and, with W&B, to an `eval` job in the run's group."""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from pathlib import Path
from typing import Optional

import jax
import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from dalle_ablate.config import RunConfig
from dalle_ablate.evaluate.runner import evaluation_or_none
from dalle_ablate.fileio import pull, shown, url_of
from dalle_ablate.parallel import compile_cache
from dalle_ablate.registry import ConfigError, first_line
from dalle_ablate.track import build_tracker
from dalle_ablate.train import checkpoint
from dalle_ablate.train.assembly import assemble
from dalle_ablate.validate import compose, to_run_config


def restore(ckpt_dir: Path, step: Optional[int], target):
    """checkpoint.restore, with a checkpoint that cannot be read (a file of it truncated or corrupt)
    named in one line: its step's folder and the innermost error orbax or TensorStore gave."""
    # orbax logs its read-only manager's settings through absl, each a warning on stderr.
    logging.getLogger("absl").setLevel(logging.CRITICAL)
    if step is None:  # the latest, as orbax finds it: a finished save is a folder named by its step
        steps = checkpoint.finished_steps(ckpt_dir)
        step = max(steps) if steps else None
    try:
        return checkpoint.restore(ckpt_dir, step, target)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure to read it is the checkpoint's
        cause = e
        while cause.__cause__ is not None:
            cause = cause.__cause__
        raise ConfigError(
            f"{ckpt_dir / str(step)}: the checkpoint of step {step} cannot be restored (truncated or "
            f"corrupt?): {first_line(cause)}"
        ) from e


# Sections that describe the machine evaluating, not the run: from today's composition, never
# from the saved config (eval runs on this machine's devices, as one process unless told, with
# this machine's compilation cache).
THIS_MACHINE = ("mesh", "distributed", "compilation_cache")
# ... and the mesh eval forces before the user's own overrides (which may still set it).
EVAL_MESH = ["mesh.data=-1", "mesh.fsdp=1", "mesh.model=1"]
_ABSENT = object()  # a key one config has and the other lacks: equal to no value


def changed_keys(base: DictConfig, want: DictConfig) -> list[str]:
    """The dotted keys whose resolved values differ between two composed configs. A section
    whose schema differs (another option chosen: `tracker=none`, `model=...`) or whose keys
    differ counts as one key, whole; otherwise the walk goes down to the fields."""
    out: list[str] = []

    def walk(b: dict, w: dict, bnode: DictConfig, wnode: DictConfig, path: str) -> None:
        for key, wv in w.items():
            full = f"{path}.{key}" if path else str(key)
            bv = b.get(key, _ABSENT)
            if (
                isinstance(wv, dict)
                and isinstance(bv, dict)
                and wv.keys() == bv.keys()
                and OmegaConf.get_type(bnode, key) is OmegaConf.get_type(wnode, key)
            ):
                walk(bv, wv, bnode[key], wnode[key], full)
            elif bv != wv:
                out.append(full)

    walk(OmegaConf.to_container(base, resolve=True), OmegaConf.to_container(want, resolve=True), base, want, "")
    return out


def _drop(tree: dict, dotted: str) -> None:
    *parents, last = dotted.split(".")
    for key in parents:
        tree = tree.get(key)
        if not isinstance(tree, dict):
            return
    tree.pop(last, None)


def _new_fields(saved: dict, want: dict, path: str = "") -> list[str]:
    """Keys of today's config that the saved config (where it has the section) lacks."""
    out: list[str] = []
    for key, wv in want.items():
        full = f"{path}.{key}" if path else str(key)
        if key not in saved:
            out.append(full)
        elif isinstance(wv, dict) and isinstance(saved[key], dict):
            out += _new_fields(saved[key], wv, full)
    return out


def run_config_for_eval(store: Path, recorded: list[str], overrides: list[str]) -> RunConfig:
    """The config a checkpoint is evaluated with: the run's own, as its run store saved it
    (`<store>/config.yaml`, resolved when it trained), not the run's recorded overrides composed
    again with today's defaults -- a default changed since the run must not change how its
    checkpoint is evaluated.

    What the command line's overrides ask for is found by composing today's config twice, from
    the run's recorded overrides alone (`base`) and with the eval mesh and the user's overrides
    added (`want`): the keys whose values differ between the two (`changed_keys`; a section with
    another option chosen, `eval=drawbench` or `tracker=none`, counts whole) are the user's. The
    result is `want` with the saved config merged over it everywhere except those keys and the
    machine's own sections (`THIS_MACHINE`: mesh, distributed and the compilation cache, from today's composition), so
    it is typed by today's schemas and checked as any run config.

    A saved config that is absent or unreadable is a ConfigError naming the file; so is one
    holding a field today's schema no longer has (or a value it cannot hold). A field today's
    schema added since the run takes today's default, and a note on stderr names each."""
    file = store / "config.yaml"
    if not file.is_file():
        raise ConfigError(f"{file}: missing; eval builds a run's config from the config.yaml its run store saved")
    try:
        saved = yaml.safe_load(file.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"{file}: cannot be read ({first_line(e)})") from None
    if not isinstance(saved, dict):
        raise ConfigError(f"{file}: holds a YAML {type(saved).__name__}, not a run's config")
    base = compose(list(recorded))
    want = compose([*recorded, *EVAL_MESH, *overrides])
    changed = changed_keys(base, want)
    kept = {k: v for k, v in saved.items() if k not in THIS_MACHINE}
    for key in changed:
        _drop(kept, key)
    try:
        cfg = OmegaConf.merge(want, kept)
    except ConfigKeyError as e:
        raise ConfigError(
            f"{file}: {e.full_key} is not a field of today's config (removed or renamed since the run)"
        ) from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"{file}: {e.full_key}: {str(e).splitlines()[0]}") from None
    ours = [*changed, *THIS_MACHINE]
    new = [
        k
        for k in _new_fields(saved, OmegaConf.to_container(want))
        if not any(k == c or k.startswith(f"{c}.") for c in ours)
    ]
    if new:
        print(f"note: {file} predates {', '.join(new)}: evaluated with today's default", file=sys.stderr, flush=True)
    return to_run_config(cfg)


def evaluate_checkpoint(path: str, overrides: list[str]) -> Path:
    ckpt_dir, step = checkpoint.find_checkpoints(path, given="dalle-ablate eval ")
    store = ckpt_dir.parent
    if url_of(store) is not None:  # a bucket's run: its store read from its copy (its evaluations go back there)
        pull(url_of(store))
    meta_file = store / "meta.json"
    if not meta_file.exists():
        raise ConfigError(f"{path}: no meta.json next to {ckpt_dir.name}/; give a run made by this tool")
    try:
        meta = json.loads(meta_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{meta_file}: not valid JSON, half-written or corrupt ({first_line(e)})") from None
    # The run's saved config, evaluated on this machine's devices in float32, with the vocabulary
    # rows padded as they were saved.
    cfg = run_config_for_eval(store, meta.get("overrides", []), overrides)
    compile_cache.configure(cfg.compilation_cache)  # before anything compiles
    run = assemble(cfg, model_axis=int(meta.get("mesh", {}).get("model", 1)), dtype="float32")
    step, state = restore(ckpt_dir, step, run.abstract_state())
    out = store / "evals" / f"{cfg.eval.name}_step{step}"
    run_name = store.parent.name
    # A W&B run of its own in the training run's group: never the training run's id (logging
    # under it would rename that run and overwrite its summary on a sync).
    own = {k: v for k, v in meta.items() if k not in ("wandb_id", "wandb_dir", "wandb_fallback")}
    own["trained_wandb_id"] = meta.get("wandb_id")
    tracker = build_tracker(
        cfg.tracker,
        out,
        dataclasses.asdict(cfg),
        {**own, "evaluated_step": step, "checkpoint": str(ckpt_dir)},
        name=f"eval {cfg.eval.name} {run_name} step {step}",
        group=meta.get("wandb_group"),
        job_type="eval",
        is_main_process=jax.process_index() == 0,
    )
    status = "failed"
    try:
        ev = evaluation_or_none(cfg, run.dataset, run.model_cfg, run.graphdef, tracker, run.placement.replicated)
        if ev is None:
            raise ConfigError(
                f"nothing to evaluate: eval.metrics={list(cfg.eval.metrics)} need scene specs or are empty, and "
                f"eval.grids={list(cfg.eval.grids)} need an image decoder (data.codebook_path or data.vqgan_path)"
            )
        result = ev.run(state.params, step, run_name)
        tracker.log_summary({"evaluated_step": step, **result["model"]})
        status = "finished"
    finally:
        tracker.finish(status)
    for row in result["pareto"]:
        print("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items() if k != "run"))
    for row in result["rerank"]:
        print(
            "rerank  "
            + "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items() if k != "run")
        )
    for k, v in result["model"].items():
        print(f"{k}={v:.4g}")
    print(f"wrote {shown(out)}")
    return out
