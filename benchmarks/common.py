"""Shared by the benchmark scripts: a fresh train step for a config, timing it, a competing
process for timings under load, and the results page each benchmark writes (`writes_page`)."""

from __future__ import annotations

import functools
import io
import os
import statistics
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results" / "benchmarks"
# The folder a benchmark writes its page into (default: the repository's docs/results/benchmarks/); "-" writes none.
PAGE_ENV = "DALLE_ABLATE_RESULTS"

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


class _Tee(io.TextIOBase):
    """What the benchmark prints: to the terminal as before, and kept for its page."""

    def __init__(self, out):
        self.out, self.kept = out, io.StringIO()

    def write(self, text: str) -> int:
        self.kept.write(text)
        return self.out.write(text)

    def flush(self) -> None:
        self.out.flush()


def machine() -> str:
    """The machine in one line: CPU model, cores, memory, and the JAX that ran."""
    import jax

    cpu = (
        next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            None,
        )
        if Path("/proc/cpuinfo").exists()
        else None
    )
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 if hasattr(os, "sysconf") else None
    devices = ", ".join(sorted({d.device_kind for d in jax.devices()}))
    return (
        f"{cpu or 'unknown CPU'}, {os.cpu_count()} cores, {mem:.0f} GiB memory; JAX {jax.__version__} on "
        f"{jax.default_backend()} ({jax.device_count()} x {devices})"
    )


def writes_page(title: str):
    """A benchmark's main() whose printed tables also become its results page,
    `docs/results/benchmarks/<script>.md` (or under $DALLE_ABLATE_RESULTS; "-" writes none): the command, the
    commit, the machine, its load before and after, the date and the time taken above what it
    printed. A benchmark that fails writes nothing, so an earlier page stays as it was."""

    def wrap(main):
        @functools.wraps(main)
        def run(*args, **kwargs):
            from dalle_ablate.fileio import atomic_write
            from dalle_ablate.train.meta import git_commit

            folder = os.environ.get(PAGE_ENV, str(RESULTS))
            commit, load, start, t = (
                git_commit(),
                os.getloadavg(),
                time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                time.perf_counter(),
            )
            tee = _Tee(sys.stdout)
            sys.stdout = tee
            try:
                result = main(*args, **kwargs)
            finally:
                sys.stdout = tee.out
            if folder == "-":
                return result
            script = Path(sys.argv[0]).name
            name = Path(script).stem.replace("_", "-")
            command = " ".join(["python", f"benchmarks/{script}", *sys.argv[1:]])
            end = os.getloadavg()
            lines = [
                f"# {title}",
                "",
                f"Written by `{command}` ({time.perf_counter() - t:.0f} s), on {start}.",
                "",
                f"Commit: {commit['commit'] or 'unknown (not a git checkout)'}"
                f"{' + uncommitted changes' if commit['dirty'] else ''}.",
                "",
                f"Machine: {machine()}; load average {load[0]:.1f} before, {end[0]:.1f} after (other jobs on the "
                f"machine slow every timing here; compare ratios measured in one run).",
                "",
                "What it printed:",
                "",
                "```text",
                tee.kept.getvalue().rstrip("\n"),
                "```",
                "",
            ]
            Path(folder).mkdir(parents=True, exist_ok=True)
            atomic_write(Path(folder) / f"{name}.md", "\n".join(lines))
            print(f"wrote {Path(folder) / f'{name}.md'}")
            return result

        return run

    return wrap
