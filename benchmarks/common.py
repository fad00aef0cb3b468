"""Shared by the benchmark scripts: a fresh train step for a config, timing it, and a competing
process for timings under load."""

from __future__ import annotations

import statistics
import time

# A second process that keeps every core busy, as a second run or a test suite would on a shared
# machine: `subprocess.Popen([sys.executable, "-c", COMPETING_LOAD])`.
COMPETING_LOAD = "import numpy as np\na = np.ones((512, 512), np.float32)\nwhile True:\n    a = (a @ a) / 512"


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


def fresh_train_step(cfg, dataset=None):
    """(jitted train step, initial TrainState, the run's Assembly: model_cfg, abstract model, ...)
    on one device, for the config's data sizes (`dataset`'s if given; else from the config,
    nothing read)."""
    import jax

    from dalle_ablate.data import abstract_sizes
    from dalle_ablate.train.assembly import assemble

    sizes = None if dataset is not None else abstract_sizes(cfg.data, cfg.model)
    run = assemble(cfg, dataset=dataset, sizes=sizes, devices=jax.devices()[:1])
    return run.train_step(), run.init_state(), run


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


def refresh_split(times: list[float], period: int) -> tuple[float, float]:
    """(median step without a root refresh, what a refresh adds) from Shampoo step times taken
    after a warm-up step (timed_steps): the refresh is the last step of each period."""
    refresh = statistics.median(times[i] for i in range(period - 1, len(times), period))
    plain = statistics.median(t for i, t in enumerate(times) if i % period != period - 1)
    return plain, refresh - plain
