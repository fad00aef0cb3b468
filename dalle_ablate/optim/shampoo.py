"""optim=shampoo: Distributed Shampoo (arXiv 2002.09018) as DALL·E Mega trained with it; the
transformation itself is `scale_by_shampoo.py`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import jax
import optax

from dalle_ablate.optim.base import OPTIMIZERS, OptimConfig, decay_mask
from dalle_ablate.optim.scale_by_shampoo import GRAFT_SCOPES, GRAFTS, ROOT_DTYPES, STATISTICS_DTYPES, scale_by_shampoo
from dalle_ablate.registry import check


@dataclass
class ShampooConfig(OptimConfig):
    RANGES = {
        "b1": "[0, 1)", "b2": "[0, 1]",  # b2 = 1: Adagrad-style sums
        "block_size": "[1, inf)", "graft_b2": "[0, 1] or null", "graft_eps": "[0, inf)", "matrix_eps": "[0, inf)",
        "exponent_override": "[0, inf)", "preconditioning_every": "[1, inf)", "start_preconditioning_step": "[0, inf)",
        "inverse_failure_threshold": "(0, inf)", "skip_preconditioning_dim_size_gt": "[1, inf)", "merge_small_dims": "[0, inf)",
        "lapack_threads": "[1, inf) or null",
    }

    name: str = "shampoo"
    lr: float = 1e-3
    block_size: int = 1024  # dimensions longer than this are split into blocks
    b1: float = 0.9  # momentum on the grafted direction
    b2: float = 0.99  # statistics decay; 1.0 = Adagrad-style sums
    graft: str = "rmsprop_normalized"  # rmsprop_normalized | rmsprop | adagrad | sgd | adam
    graft_b2: Optional[float] = None  # null: b2, as the reference has one beta2
    graft_eps: float = 1e-10  # Mega's diagonal_epsilon
    # parameter: each parameter's Shampoo direction takes its graft direction's norm, as the
    # reference; block: each block's (this project's rule before issue 15; blocks of one matrix
    # then move at different rates).
    graft_scope: str = "parameter"
    matrix_eps: float = 1e-6  # ridge, relative to the largest eigenvalue
    exponent_override: int = 0  # 0 = 2 x the statistics per block (4 for matrices, 2 for vectors)
    preconditioning_every: int = 10  # recompute inverse roots every k steps
    start_preconditioning_step: int = 101  # graft direction alone before this step
    inverse_failure_threshold: float = 0.1  # keep the previous root above this eigh backward error
    skip_preconditioning_dim_size_gt: int = 4096  # graft only for any larger dimension
    # Vectors (biases, norm gains) preconditioned by their one statistic, as Mega ran it
    # (skip_preconditioning_rank_lt=1); false leaves them to the graft, which is cheaper.
    precondition_1d: bool = True
    # Neighbouring dims are merged while their product is at most this (the reference's
    # merge_small_dims_block_size), so a 64 x 64 matrix is preconditioned as a 4096-vector: four
    # 1024-blocks and 1024 x 1024 roots instead of two 64 x 64. 0 keeps every matrix a matrix.
    merge_small_dims: int = 4096
    moving_average_for_momentum: bool = True  # EMA momentum (dalle-mini's setting) instead of heavy ball
    nesterov: bool = False
    statistics_dtype: str = "float32"  # float32 | bfloat16 for statistics and roots
    # Where inverse roots are computed: auto = float64 where the backend has it (CPU, GPU), float32
    # on TPU. float32 roots of ill-conditioned statistics are off by up to ~1e-3 (scale_by_shampoo.py).
    root_dtype: str = "auto"
    # Threads of the BLAS under JAX's CPU eigh (process-wide, on a CPU backend only): its OpenBLAS
    # busy-waits, and beside another busy process a refresh of size=small's roots took 6.8x its
    # idle time with a thread per core, 1.7x with one (limit_lapack_threads below).
    # null leaves the library's own choice.
    lapack_threads: Optional[int] = 1
    # Parameters whose path matches one of these get the graft direction only (Mega: embeddings).
    no_precondition: list[str] = field(default_factory=lambda: ["embed", "lm_head"])

    def validate(self, run) -> None:
        super().validate(run)
        for name, valid in (("graft", GRAFTS), ("graft_scope", GRAFT_SCOPES), ("statistics_dtype", STATISTICS_DTYPES),
                            ("root_dtype", ("auto", *ROOT_DTYPES))):
            value = getattr(self, name)
            check(value in valid, f"optim.{name}={value!r} is not valid; valid: {', '.join(sorted(valid))}")
        decay_mask(self.no_precondition, "optim.no_precondition")


def root_dtype(name: str) -> str:
    """optim.root_dtype: auto is float64 unless the backend is a TPU, which has no float64."""
    return ("float32" if jax.default_backend() == "tpu" else "float64") if name == "auto" else name


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
        block_size=cfg.block_size, beta1=cfg.b1, beta2=cfg.b2, graft=cfg.graft, graft_beta2=cfg.graft_b2,
        graft_eps=cfg.graft_eps, graft_scope=cfg.graft_scope, matrix_eps=cfg.matrix_eps, exponent_override=cfg.exponent_override,
        preconditioning_every=cfg.preconditioning_every, start_preconditioning_step=cfg.start_preconditioning_step,
        inverse_failure_threshold=cfg.inverse_failure_threshold,
        skip_preconditioning_dim_size_gt=cfg.skip_preconditioning_dim_size_gt, precondition_1d=cfg.precondition_1d,
        merge_small_dims=cfg.merge_small_dims,
        moving_average_for_momentum=cfg.moving_average_for_momentum, nesterov=cfg.nesterov,
        statistics_dtype=cfg.statistics_dtype, root_dtype=root_dtype(cfg.root_dtype),
        precondition_mask=decay_mask(cfg.no_precondition, "optim.no_precondition"), stack_sharding=stack_sharding,
    )
    return optax.chain(
        direction,
        optax.add_decayed_weights(cfg.weight_decay, mask=decay_mask(cfg.wd_exclude)),
        optax.scale_by_learning_rate(lr),
    )
