"""Run in a subprocess with N fake CPU devices (XLA_FLAGS set by the caller): for each mesh and
optimizer, three train steps of a small model on fixed random batches; prints JSON with the
losses and each parameter's sharding spec as placed.

    python tests/mesh_worker.py '[[8,1,1],[2,2,2]]' adam,shampoo
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# Shampoo with a ridge of 1e-2: after one or two steps the statistics are nearly singular, and
# with the default 1e-6 the inverse 4th root amplifies float32 reduction-order noise (a sum split
# over devices) into visibly different updates. A larger ridge keeps the parity test about the
# sharding, not about the conditioning of a two-step-old statistic. merge_small_dims=0 keeps the
# 64 x 64 matrices matrices (merged into 4096-vectors they would need 1024 x 1024 roots: minutes
# on 8 fake devices sharing two cores).
OPTIM = {
    "adam": ["optim=adam", "optim.lr=1e-2", "schedule=constant", "schedule.warmup_steps=0"],
    "shampoo": [
        "optim=shampoo",
        "optim.lr=1e-3",
        "schedule=constant",
        "schedule.warmup_steps=0",
        "optim.start_preconditioning_step=1",
        "optim.preconditioning_every=2",
        "optim.matrix_eps=1e-2",
        "optim.merge_small_dims=0",
    ],
}
MODEL = ["model.d_model=64", "model.heads=8", "model.ffn_dim=128", "model.encoder_layers=2", "model.decoder_layers=2"]
# The meshes' model: one decoder layer fewer (every kind of parameter still there, ~1/4 less to
# compile for each of a test's mesh x optimizer runs), and Shampoo's stacks still of 16 blocks,
# divisible over 8 devices (one encoder layer fewer would leave none that 8 divides).
MESH_MODEL = [*MODEL[:-1], "model.decoder_layers=1"]
BATCH = 16


def batches(cfg, n: int):
    import numpy as np

    rng = np.random.default_rng(0)
    for _ in range(n):
        lengths = rng.integers(2, cfg.text_len, BATCH)
        yield {
            "text": rng.integers(4, cfg.text_vocab, (BATCH, cfg.text_len)).astype(np.int32),
            "text_mask": np.arange(cfg.text_len)[None] < lengths[:, None],
            "codes": rng.integers(0, cfg.image_vocab, (BATCH, cfg.image_len)).astype(np.int32),
            "weights": np.ones(BATCH, np.float32),
        }


def run(mesh_sizes: list[int], optim: str) -> dict:
    import jax

    from conftest import run_config
    from dalle_ablate.optim import path_str
    from dalle_ablate.train.assembly import assemble

    d, f, m = mesh_sizes
    cfg = run_config(
        *MESH_MODEL, *OPTIM[optim], f"mesh.data={d}", f"mesh.fsdp={f}", f"mesh.model={m}", f"trainer.batch_size={BATCH}"
    )
    run = assemble(cfg, sizes={"image_len": 16, "image_vocab": 50, "text_vocab": 40})
    mcfg, mesh, placement = run.model_cfg, run.mesh, run.placement
    state, step = run.init_state(), run.train_step()
    losses = []
    for b in batches(mcfg, 3):
        state, metrics = step(state, placement.global_batch(b, BATCH))
        losses.append(float(metrics["train/loss"]))
    placed = {
        path_str(p): [list(a) if isinstance(a, tuple) else a for a in x.sharding.spec]
        for p, x in jax.tree_util.tree_flatten_with_path(state.params)[0]
    }
    stacks = [
        [x.shape[0], [list(a) if isinstance(a, tuple) else a for a in x.sharding.spec]]
        for x in jax.tree.leaves(state.opt_state)
        if x.ndim == 3
    ]
    return {"losses": losses, "params": placed, "stack_specs": stacks, "devices": len(mesh.devices.flat)}


def main() -> None:
    meshes = json.loads(sys.argv[1])
    out = {f"{tuple(mesh)}/{o}": run(mesh, o) for mesh in meshes for o in sys.argv[2].split(",")}
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
