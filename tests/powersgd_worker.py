"""Run in a subprocess with 8 fake CPU devices (XLA_FLAGS set by the caller). Prints JSON with:
- `oracle`: the worst deviation, over three steps, of PowerSGD under shard_map on the 8-device
  data mesh from a NumPy implementation of the algorithm (arXiv 1905.13727, Alg. 1) that loops
  over the 8 workers on one device;
- `train`: the losses and final parameters of three Adam steps (two micro-batches each) of a
  small model on the 8-device data mesh with full-rank PowerSGD and without compression (full
  rank is exact); eps = 1 makes
  the update linear in the gradient, so the parameters show the gradients' difference unamplified.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/powersgd_worker.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

W, RANK = 8, 2
SHAPES = {"w": (12, 10), "stack": (2, 6, 5), "bias": (10,), "embed": (20, 6)}  # embed: excluded by name


def oracle(grads: list[dict], q: dict, err: dict) -> tuple[dict, dict, dict]:
    """One PowerSGD step on one device: per-worker gradients (shares of the global sum) -> mean,
    new Q, new per-worker residuals. Written from the paper, in NumPy float64."""
    mean, new_q, new_err = {}, {}, {}
    for name in SHAPES:
        if name in ("bias", "embed"):
            mean[name] = sum(g[name] for g in grads)
            continue
        m = [W * g[name] + err[name][w] for w, g in enumerate(grads)]
        p = sum(x @ q[name] for x in m) / W
        p_hat = np.linalg.qr(p)[0]
        new_q[name] = sum(np.swapaxes(x, -1, -2) @ p_hat for x in m) / W
        approx = p_hat @ np.swapaxes(new_q[name], -1, -2)
        mean[name] = approx
        new_err[name] = np.stack([x - approx for x in m])
    return mean, new_q, new_err


def oracle_check() -> float:
    from jax.sharding import Mesh

    from dalle_ablate.optim import PowerSGDState, powersgd_mean
    from dalle_ablate.optim.powersgd import powersgd_init
    from dalle_ablate.parallel import over_data

    mesh = Mesh(np.asarray(jax.devices()).reshape(W, 1, 1), ("data", "fsdp", "model"))
    params = {k: jnp.zeros(s) for k, s in SHAPES.items()}
    state = powersgd_init(params, RANK, ["embed"], W)
    q = {k: np.asarray(v, np.float64) for k, v in state.q.items()}
    err = {k: np.zeros((W, *SHAPES[k])) for k in ("w", "stack")}
    fn = jax.jit(
        over_data(
            lambda g, s: powersgd_mean(jax.tree.map(lambda x: x[0], g), s, ["embed"], "data", W)[:2],
            mesh,
            in_split=(True, PowerSGDState(q=False, error=True)),
            out_split=(False, PowerSGDState(q=False, error=True)),
        )
    )
    rng, worst = np.random.default_rng(0), 0.0
    for _ in range(3):
        grads = [{k: rng.normal(size=s) / W for k, s in SHAPES.items()} for _ in range(W)]
        stacked = {k: jnp.asarray(np.stack([g[k] for g in grads]), jnp.float32) for k in SHAPES}
        mean, state = fn(stacked, state)
        want, q, err = oracle(grads, q, err)
        for k in SHAPES:
            worst = max(worst, float(np.max(np.abs(np.asarray(mean[k]) - want[k])) / np.max(np.abs(want[k]))))
        for k in err:
            worst = max(worst, float(np.max(np.abs(np.asarray(state.error[k]) - err[k])) / np.max(np.abs(err[k]))))
    return worst


def train(rank: str) -> dict:
    from conftest import run_config
    from mesh_worker import MODEL, batches
    from dalle_ablate.train.assembly import assemble

    cfg = run_config(
        *MODEL,
        "optim=adam",
        "optim.lr=1e-2",
        "optim.eps=1.0",
        "schedule=constant",
        "schedule.warmup_steps=0",
        "mesh.data=8",
        "trainer.batch_size=16",
        "trainer.grad_accum=2",
        f"optim.powersgd.rank={rank}",
    )
    run = assemble(cfg, sizes={"image_len": 16, "image_vocab": 50, "text_vocab": 40})
    state, step = run.init_state(), run.train_step()
    losses = []
    for b in batches(run.model_cfg, 3):
        state, metrics = step(state, run.placement.global_batch(b, 16))
        losses.append(float(metrics["train/loss"]))
    return {
        "losses": losses,
        "params": [np.asarray(x).ravel().tolist() for x in jax.tree.leaves(state.params)],
        "compression": float(metrics.get("comm/compression", 1.0)),
    }


def main() -> None:
    full, plain = train("100000"), train("null")
    params_dev = max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(full["params"], plain["params"])
    )
    print(
        "RESULT "
        + json.dumps(
            {
                "oracle": oracle_check(),
                "devices": jax.device_count(),
                "losses_full": full["losses"],
                "losses_plain": plain["losses"],
                "params_dev": params_dev,
                "compression_full": full["compression"],
            }
        )
    )


if __name__ == "__main__":
    main()
