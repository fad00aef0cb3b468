"""Run in a subprocess with N fake CPU devices (XLA_FLAGS set by the caller): seeds as members of
one job (train/loop.py `train_members`) or the separate runs `seed=k` (loop.train), each into
its own run store under OUT; prints JSON with where the members' stacked state and batches were
placed, and how `member_slice` lays out one member of a model-split stack.

    python tests/members_worker.py OUT members '{"a": ["seeds=[0,1]", "mesh.member=2"]}'
    python tests/members_worker.py OUT runs '{"seed0": ["seed=0", "mesh.data=1"]}'
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# Three steps of the tiny model (TINY_TRAIN), every step logged; validated and saved at step 3.
STEPS = [
    "trainer.steps=3",
    "trainer.log_every=1",
    "trainer.eval_every=3",
    "trainer.save_every=3",
    "trainer.eval_batches=2",
    "tracker=none",
]


def spec(sharding) -> list:
    return [list(a) if isinstance(a, tuple) else a for a in sharding.spec]


def placed(x) -> dict:
    """A stacked array's spec and, for each member (its index on the leading axis), the devices
    holding part of it."""
    holders: dict[int, set] = {}
    for s in x.addressable_shards:
        for i in range(x.shape[0])[s.index[0]]:
            holders.setdefault(i, set()).add(s.device.id)
    return {"spec": spec(x.sharding), "holders": [sorted(holders.get(i, ())) for i in range(x.shape[0])]}


def run_members(out: Path, name: str, overrides: list[str]) -> dict:
    import jax

    from conftest import run_config
    from dalle_ablate.train import program
    from dalle_ablate.train.loop import JobInfo, train_members

    cfg = run_config(*STEPS, *overrides)
    seen: dict = {}
    make_step = program.members_step

    def watched_step(*args, **kwargs):  # the state as the compiled step returns it, the batch it was given
        step = make_step(*args, **kwargs)

        def run(ms, batch):
            seen["batch"] = placed(batch["codes"])
            new, metrics = step(ms, batch)
            seen["state"] = new
            return new, metrics

        return run

    program.members_step = watched_step
    try:
        job = JobInfo(job_dir=out / name, name=name, overrides=list(overrides))
        jobs = [JobInfo(job_dir=out / name / f"seed{k}", name=f"seed={k}", overrides=[f"seed={k}"]) for k in cfg.seeds]
        results = train_members(cfg, job, jobs)
    finally:
        program.members_step = make_step
    params = seen["state"].state.params
    return {
        "status": [r.status for r in results],
        "eval_loss": [r.eval_loss for r in results],
        "run_dirs": [str(r.run_dir) for r in results],
        "batch": seen["batch"],
        "params": {jax.tree_util.keystr(p): placed(x) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]},
        "mesh": dict(jax.tree.leaves(params)[0].sharding.mesh.shape),
    }


def slice_layout() -> dict:
    """member_slice of a stack [2 members, 6, 8] on a (member 2, data 1, fsdp 1, model 2) mesh,
    its last axis split over model: the slice's spec, the shapes of its shards and its values."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from dalle_ablate.train.member_program import member_slice

    mesh = Mesh(np.asarray(jax.devices()).reshape(2, 1, 1, 2), ("member", "data", "fsdp", "model"))
    value = np.arange(2 * 6 * 8, dtype=np.float32).reshape(2, 6, 8)
    one = member_slice({"w": jax.device_put(value, NamedSharding(mesh, P("member", None, "model")))}, 1)["w"]
    return {
        "spec": spec(one.sharding),
        "shards": sorted({s.data.shape for s in one.addressable_shards}),
        "equal": bool(np.array_equal(np.asarray(one), value[1])),
    }


def run_separate(out: Path, name: str, overrides: list[str]) -> dict:
    from conftest import run_config
    from dalle_ablate.train.loop import JobInfo, train

    result = train(run_config(*STEPS, *overrides), JobInfo(job_dir=out / name, name=name, overrides=list(overrides)))
    return {"status": result.status, "eval_loss": result.eval_loss, "run_dir": str(result.run_dir)}


def main() -> None:
    import jax

    out, kind, jobs = Path(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
    fn = run_members if kind == "members" else run_separate
    result = {
        "devices": jax.device_count(),
        "jobs": {name: fn(out, name, overrides) for name, overrides in jobs.items()},
    }
    if kind == "members":
        result["slice"] = slice_layout()
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
