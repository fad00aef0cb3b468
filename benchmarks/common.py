"""Shared by the benchmark scripts: a fresh train step for a config, and timing it."""

from __future__ import annotations

import time


def offline_workdir(prefix: str):
    """A fresh temp folder for the benchmark's runs, with W&B offline and writing into it (set
    before anything imports wandb). Returns its Path."""
    import os
    import tempfile
    from pathlib import Path

    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ.setdefault("WANDB_DIR", str(tmp))
    return tmp


def fresh_train_step(cfg, model_cfg):
    """(jitted train step, initial TrainState, parameter count) for a resolved model config."""
    import jax.numpy as jnp
    from flax import nnx

    from dalle_ablate.model import build_model, param_count
    from dalle_ablate.optim import build_optimizer
    from dalle_ablate.train.step import TrainState, make_train_step

    model = build_model(model_cfg, cfg.seed)
    n_params = param_count(model)
    graphdef, params = nnx.split(model, nnx.Param)
    params = nnx.to_pure_dict(params)
    opt, sched = build_optimizer(cfg.optim, cfg.schedule, cfg.trainer.steps)
    state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt.init(params))
    return make_train_step(graphdef, opt, sched, cfg.trainer.grad_accum, cfg.seed), state, n_params


def timed_steps(step, state, batch, n: int) -> tuple[object, list[float], float]:
    """Run one warm-up step, then n steps each waited for; (state, seconds per step, last loss)."""
    import jax

    state, m = step(state, batch)
    jax.block_until_ready(m["train/loss"])
    times = []
    for _ in range(n):
        t = time.perf_counter()
        state, m = step(state, batch)
        jax.block_until_ready(m["train/loss"])
        times.append(time.perf_counter() - t)
    return state, times, float(m["train/loss"])


def random_batch(model_cfg, batch_size: int, seed: int = 0) -> dict:
    """A fixed batch of random tokens (full-length captions) shaped for the model."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return {
        "text": rng.integers(4, model_cfg.text_vocab, (batch_size, model_cfg.text_len)).astype(np.int32),
        "text_mask": np.ones((batch_size, model_cfg.text_len), bool),
        "codes": rng.integers(0, model_cfg.image_vocab, (batch_size, model_cfg.image_len)).astype(np.int32),
        "weights": np.ones(batch_size, np.float32),
    }
