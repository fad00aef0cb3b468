"""The train state's named parts on disk: saved and restored by name; a checkpoint of 0.1.0's
positional layout refused in one line; a plain run's checkpoint, whose layout did not change,
restored."""

from __future__ import annotations

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from conftest import run_config
from dalle_ablate.registry import RunFailed
from dalle_ablate.train import checkpoint
from dalle_ablate.train.assembly import assemble

SIZES = {"image_len": 16, "image_vocab": 50, "text_vocab": 40}


def _run(*overrides):
    return assemble(run_config("trainer.batch_size=8", *overrides), sizes=SIZES)


def _save_raw(directory, step: int, tree) -> None:
    """`tree` written as orbax writes a train state, whatever its shape (0.1.0 saved a TrainState
    whose opt_state held the scaler's state first)."""
    mngr = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(create=True))
    mngr.save(step, args=ocp.args.StandardSave(tree))
    mngr.wait_until_finished()
    mngr.close()


def _equal(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


def test_the_scaler_is_saved_and_restored_by_its_name(tmp_path):
    r = _run("model.dtype=float16", "trainer.grad_scaling=per_block")
    state = r.init_state()
    state = state.replace(scaler=state.scaler._replace(skipped=state.scaler.skipped + 7))
    saver = checkpoint.Checkpointer(tmp_path / "ckpt", keep=2)
    saver.save(5, state)
    saver.close()
    tree = ocp.CheckpointManager(tmp_path / "ckpt", item_handlers=ocp.StandardCheckpointHandler()).item_metadata(5).tree
    assert set(tree) == {"step", "params", "opt_state", "scaler", "compression"} and not jax.tree.leaves(
        tree["compression"]
    )
    step, restored = checkpoint.restore(tmp_path / "ckpt", None, r.abstract_state())
    assert step == 5 and int(restored.scaler.skipped) == 7 and restored.compression is None
    assert _equal(restored, state)


def test_a_checkpoint_of_the_positional_layout_is_refused_in_one_line_and_kept(tmp_path):
    r = _run("model.dtype=float16", "trainer.grad_scaling=global")
    state = r.init_state()
    old = {"step": state.step, "params": state.params, "opt_state": (state.scaler, state.opt_state)}
    _save_raw(tmp_path / "ckpt", 4, old)
    broken = []
    with pytest.raises(RunFailed) as e:
        checkpoint.restore(tmp_path / "ckpt", None, r.abstract_state(), on_broken=broken.append)
    assert str(e.value) == (
        f"checkpoint {tmp_path / 'ckpt' / '4'} was written by dalle-ablate 0.1.0, whose train state kept the scaler state "
        f"inside opt_state by position; this release names them and cannot restore it: resume it with 0.1.0, or remove "
        f"the run folder to start over"
    )
    assert broken == [] and (tmp_path / "ckpt" / "4").is_dir()


def test_a_plain_runs_checkpoint_has_the_same_layout_as_before_and_restores(tmp_path):
    r = _run()
    state = r.init_state()
    _save_raw(tmp_path / "ckpt", 3, {"step": state.step, "params": state.params, "opt_state": state.opt_state})
    step, restored = checkpoint.restore(tmp_path / "ckpt", None, r.abstract_state())
    assert step == 3 and restored.scaler is None and _equal(restored, state)
