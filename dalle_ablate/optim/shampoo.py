"""optim=shampoo: Distributed Shampoo (arXiv 2002.09018) as DALL·E Mega trained with it; the
transformation itself is `scale_by_shampoo.py`."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import jax
import optax

from dalle_ablate.optim.base import OPTIMIZERS, OptimConfig, decay_mask
from dalle_ablate.optim.scale_by_shampoo import ShampooOptions, scale_by_shampoo
from dalle_ablate.registry import check


def with_options(options: type) -> Callable[[type], type]:
    """Gives a config class, before @dataclass sees it, a field for each field of the frozen
    `options` record (type and default as there, first) and remembers the record as `OPTIONS`, so
    that each Shampoo option is listed once, in `ShampooOptions`, and the config builds the record
    the transformation takes with `cfg.options()`."""

    def add(cls: type) -> type:
        hints = typing.get_type_hints(options)
        own = cls.__dict__.get("__annotations__", {})
        cls.__annotations__ = {**{f.name: hints[f.name] for f in dataclasses.fields(options)}, **own}
        for f in dataclasses.fields(options):
            setattr(cls, f.name, f.default)  # every option's default is immutable: the record is frozen
        cls.OPTIONS = options
        return cls

    return add


@dataclass
@with_options(ShampooOptions)
class ShampooConfig(OptimConfig):
    """optim=shampoo: the fields of `ShampooOptions` (range-checked there, when `options()` builds
    the record), and what concerns this option's wiring rather than the transformation."""

    RANGES = {"lapack_threads": "[1, inf) or null"}

    name: str = "shampoo"
    # Threads of the BLAS under JAX's CPU eigh (process-wide, on a CPU backend only): its OpenBLAS
    # busy-waits, and beside another busy process a refresh of size=small's roots took 6.8x its
    # idle time with a thread per core, 1.7x with one (limit_lapack_threads below).
    # null leaves the library's own choice.
    lapack_threads: Optional[int] = 1
    # Parameters whose path matches one of these get the graft direction only (Mega: embeddings).
    no_precondition: list[str] = field(default_factory=lambda: ["embed", "lm_head"])

    def options(self) -> ShampooOptions:
        """The frozen record the transformation reads, checked (ranges, choices) as it is built."""
        return self.OPTIONS(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self.OPTIONS)})

    def validate(self, run) -> None:
        super().validate(run)
        self.options()
        decay_mask(self.no_precondition, "optim.no_precondition")
        # Measured (docs/results/benchmarks/members-shampoo.md): under vmap the refresh's lax.cond becomes a
        # select -- the roots recomputed at every step, by two batched eighs, the pattern that can
        # deadlock jaxlib's CPU eigh (inverse_roots.py) -- and the float64 roots do not compile (the
        # select's re-trace runs outside their enable_x64). lax.map keeps each member's own program.
        check(
            not (run.seeds and run.members.impl == "vmap"),
            "optim=shampoo with seeds=[...] runs only with members.impl=map: under vmap its root refresh would run "
            "at every step as two batched eighs (the CPU deadlock of optim/inverse_roots.py), and float64 roots do "
            "not compile",
        )


def root_dtype(name: str) -> str:
    """optim.root_dtype: auto is float64 unless the backend is a TPU, which has no float64."""
    return ShampooOptions(root_dtype=name).roots_in


def limit_lapack_threads(threads: int) -> int:
    """Caps the threads of the BLAS under jaxlib's CPU LAPACK kernels (eigh among them) at
    `threads`, process-wide; returns how many BLAS libraries were capped.

    jaxlib takes its LAPACK from SciPy (`scipy.linalg.cython_lapack`), whose OpenBLAS starts one
    thread per core and busy-waits for work. Beside XLA's own intra-op threads, on a machine whose
    cores something else also uses, those threads wait for cores that are taken: on 2 cores with a
    second process busy, a refresh of size=small's roots in the train step took 6.8x its idle time
    (13x run alone) where a plain step took 2.5x; with one BLAS thread 1.7x (2.1x), at a cost of
    6-23 % idle (benchmarks/shampoo_refresh.py, issue 15). Only SciPy's own BLAS is capped where it
    ships one (a wheel's `scipy.libs`), NumPy's is left alone; where SciPy ships none (it links a
    system BLAS), every BLAS loaded is capped."""
    import scipy
    import scipy.linalg.cython_lapack  # noqa: F401  loads the BLAS before threadpoolctl looks
    from threadpoolctl import ThreadpoolController

    blas = [lib for lib in ThreadpoolController().lib_controllers if lib.user_api == "blas"]
    root = Path(scipy.__file__).resolve().parent.parent
    own = [lib for lib in blas if Path(lib.filepath).resolve().parent in (root / "scipy.libs", root / "scipy")]
    for lib in own or blas:
        lib.set_num_threads(threads)
    return len(own or blas)


@OPTIMIZERS.option("shampoo", ShampooConfig)
def shampoo(cfg: ShampooConfig, lr, stack_sharding) -> optax.GradientTransformation:
    if cfg.lapack_threads is not None and jax.default_backend() == "cpu":
        limit_lapack_threads(cfg.lapack_threads)
    # The grafted Shampoo direction with momentum, then decoupled weight decay, then the rate.
    direction = scale_by_shampoo(
        cfg.options(),
        stack_sharding=stack_sharding,
        precondition_mask=decay_mask(cfg.no_precondition, "optim.no_precondition"),
    )
    return optax.chain(
        direction,
        optax.add_decayed_weights(cfg.weight_decay, mask=decay_mask(cfg.wd_exclude)),
        optax.scale_by_learning_rate(lr),
    )
