"""PowerSGD gradient compression over the data-parallel axis (Vogels et al. 2019, arXiv 1905.13727),
as DALL·E trained with it (arXiv 2102.12092, sec. 2.5 and appendix D): each worker's gradient
matrix M (plus its error-feedback residual) is all-reduced as two thin factors, P = M Q and
Q = Mᵀ P̂, instead of M itself. One power iteration per step, warm-started from the previous Q;
P orthogonalised in float32; what the low-rank mean misses of each worker's M is kept by that
worker and added to its next gradient (error feedback), so nothing is lost, only delayed.

Only ≥ 2-D parameters not matched by `exclude` are compressed (DALL·E excluded embeddings, the
head, gains and biases, reduced in float32); the rest is all-reduced whole. A parameter of more
than two dimensions (layers stacked by scan) is a batch of matrices over its last two axes.

`powersgd_mean` runs under `shard_map` over the data axis (train/gradients.py): its `psum`s are the
run's only gradient communication, so what crosses the wire really is the factors.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp

from dalle_ablate.registry import ConfigError, OptionConfig, check


@dataclass
class PowerSGDConfig(OptionConfig):
    """optim.powersgd: rank null = gradients all-reduced whole (no compression)."""

    RANGES = {"rank": "[1, inf) or null"}

    rank: Optional[int] = None  # per matrix, capped at min(rows, columns) (= exact)
    # Parameters whose path matches one of these regexes are all-reduced uncompressed, as are all
    # parameters of fewer than two dimensions (gains, biases).
    exclude: list[str] = field(default_factory=lambda: ["embed", "head"])

    def validate(self, run) -> None:
        try:
            [re.compile(p) for p in self.exclude]
        except re.error as e:
            raise ConfigError(f"optim.powersgd.exclude has an invalid regex: {e}") from e
        if self.rank is not None:
            check(
                run.mesh.fsdp == 1 and run.mesh.model == 1,
                f"optim.powersgd.rank={self.rank} compresses data-parallel gradients and needs mesh.fsdp=1 and "
                f"mesh.model=1 (got mesh.fsdp={run.mesh.fsdp}, mesh.model={run.mesh.model})",
            )


class PowerSGDState(NamedTuple):
    """q: [..., columns, r] per compressed parameter (the same on every worker); error:
    [workers, *shape] per compressed parameter, row w held by data-parallel worker w. Both are
    nested dicts shaped like the parameter tree, holding only the compressed parameters."""

    q: Any
    error: Any


def _keys(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def compressed_leaves(params, exclude: list[str]) -> dict[tuple[str, ...], Any]:
    """{path keys: leaf} of the parameters PowerSGD compresses."""
    patterns = [re.compile(p) for p in exclude]
    out = {}
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        keys = _keys(path)
        if len(x.shape) >= 2 and not any(r.search("/".join(keys)) for r in patterns):
            out[keys] = x
    return out


def _nest(flat: dict[tuple[str, ...], Any]) -> dict:
    root: dict = {}
    for keys, v in flat.items():
        node = root
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = v
    return root


def _get(tree: dict, keys: tuple[str, ...]):
    for k in keys:
        tree = tree[k]
    return tree


def _rank(shape, rank: int) -> int:
    return min(rank, shape[-2], shape[-1])


def powersgd_init(params, rank: int, exclude: list[str], workers: int) -> PowerSGDState:
    """Q from a fixed Gaussian draw per parameter (every worker must start from the same Q) and
    zero residuals."""
    leaves = compressed_leaves(params, exclude)
    q, err = {}, {}
    for i, (keys, x) in enumerate(leaves.items()):
        shape = tuple(x.shape)
        q[keys] = jax.random.normal(
            jax.random.fold_in(jax.random.key(0), i), (*shape[:-2], shape[-1], _rank(shape, rank)), jnp.float32
        )
        err[keys] = jnp.zeros((workers, *shape), jnp.float32)
    return PowerSGDState(q=_nest(q), error=_nest(err))


def traffic(params, rank: Optional[int], exclude: list[str]) -> dict[str, int]:
    """Floats all-reduced per step: `full` without compression, `sent` with rank-`rank` PowerSGD
    (the compressed parameters' P and Q, everything else whole), from shapes alone."""
    full = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    if rank is None:
        return {"full": full, "sent": full}
    sent = full
    for x in compressed_leaves(params, exclude).values():
        *batch, n, m = x.shape
        sent += math.prod(batch) * (n + m) * _rank(x.shape, rank) - math.prod(x.shape)
    return {"full": full, "sent": sent}


def _orthonormal(p: jax.Array) -> jax.Array:
    """An orthonormal basis of P's columns, in float32 (QR: Gram-Schmidt's result, stabler)."""
    return jnp.linalg.qr(p.astype(jnp.float32))[0]


def powersgd_mean(grads, state: PowerSGDState, exclude: list[str], axis_name: str, workers: int, measure=False):
    """(the mean gradient as compressed communication gives it, the new state, stats), inside
    `shard_map` over `axis_name`. `grads` are this worker's share of the global gradient (they
    sum over workers to it, as the loss is normalised by the global batch weight); `state.error`
    holds this worker's row ([1, *shape]). Stats: `rel_error`, |compressed mean - true mean| /
    |true mean| over the compressed parameters, where `measure` (a traced bool) is true -- it
    all-reduces the residuals, as much traffic as no compression, so the step asks for it only on
    logging steps -- and NaN elsewhere."""
    leaves = compressed_leaves(grads, exclude)
    psum = lambda x: jax.lax.psum(x, axis_name)  # noqa: E731
    new_q, new_err, approx_of = {}, {}, {}
    for keys, g in leaves.items():
        m = (
            workers * g.astype(jnp.float32) + _get(state.error, keys)[0]
        )  # this worker's estimate of the mean, plus its residual
        p_hat = _orthonormal(psum(m @ _get(state.q, keys)) / workers)
        q = psum(jnp.swapaxes(m, -1, -2) @ p_hat) / workers
        approx = p_hat @ jnp.swapaxes(q, -1, -2)
        residual = m - approx
        new_q[keys], new_err[keys], approx_of[keys] = q, residual[None], approx

    def exact_error():
        # the workers' residuals average to (true mean - compressed mean), exactly
        miss = {k: psum(new_err[k][0]) / workers for k in approx_of}
        num = sum(jnp.sum(v**2) for v in miss.values())
        return jnp.sqrt(num / jnp.maximum(sum(jnp.sum((approx_of[k] + miss[k]) ** 2) for k in approx_of), 1e-30))

    rel = jax.lax.cond(measure, exact_error, lambda: jnp.float32(jnp.nan)) if approx_of else jnp.float32(0.0)
    mean = jax.tree_util.tree_map_with_path(
        lambda path, g: approx_of[_keys(path)].astype(g.dtype) if _keys(path) in approx_of else psum(g), grads
    )
    return mean, PowerSGDState(q=_nest(new_q), error=_nest(new_err)), {"rel_error": rel}
