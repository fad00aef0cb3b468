"""One process of a multi-host run (or a single-process reference): trains the mesh-test model
with `train()` into JOB_DIR and prints the process index and the final eval loss.

    JAX_COORDINATOR_ADDRESS=127.0.0.1:PORT JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=i \\
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/multihost_worker.py JOB_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    import jax

    from conftest import run_config
    from dalle_ablate.train.loop import JobInfo, train
    from mesh_worker import MESH_MODEL, OPTIM

    cfg = run_config(
        *MESH_MODEL,
        *OPTIM["adam"],
        "mesh.data=2",
        "mesh.fsdp=2",
        "mesh.model=2",
        "trainer.batch_size=16",
        "trainer.steps=3",
        "trainer.eval_every=3",
        "trainer.save_every=3",
        "trainer.eval_batches=2",
        "tracker=none",
    )
    result = train(cfg, JobInfo(job_dir=Path(sys.argv[1])))
    print(
        "RESULT "
        + json.dumps(
            {
                "process": jax.process_index(),
                "processes": jax.process_count(),
                "devices": jax.device_count(),
                "eval_loss": result.eval_loss,
                "status": result.status,
            }
        )
    )


if __name__ == "__main__":
    main()
