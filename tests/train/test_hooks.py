"""The loop's periodic hooks (train/hooks.py): when each is due, their order, a stop."""

from __future__ import annotations

import pytest

from dalle_ablate.train.hooks import Hooks


def test_each_hook_runs_every_n_steps_and_at_the_last_in_the_order_added():
    hooks, calls = Hooks(last_step=10), []
    hooks.add("a", lambda step, state: calls.append(("a", step)), every=4)
    hooks.add("b", lambda step, state: calls.append(("b", step)), every=0)  # the last step only
    hooks.add("c", lambda step, state: calls.append(("c", step)), every=5)
    for step in range(1, 11):
        due = hooks.due(step)
        if due:
            assert hooks.run(step, None, due) is None
    assert calls == [("a", 4), ("c", 5), ("a", 8), ("a", 10), ("b", 10), ("c", 10)]


def test_a_hook_stops_the_run_with_its_reason_after_the_others_due_ran():
    hooks, ran = Hooks(last_step=100), []
    hooks.add("stop", lambda step, state: f"stopped at {step}", every=3)
    hooks.add("after", lambda step, state: ran.append(step), every=3)
    assert hooks.run(6, None, hooks.due(6)) == "stopped at 6" and ran == [6]
    assert hooks.run(6, None, ("after",)) is None  # only the named ones run


def test_a_name_is_registered_once():
    hooks = Hooks(last_step=5)
    hooks.add("checkpoint", lambda step, state: None, every=2)
    with pytest.raises(ValueError, match=r"^a hook named 'checkpoint' is already registered$"):
        hooks.add("checkpoint", lambda step, state: None, every=3)


def test_a_callers_periodic_action_is_one_registration_from_outside_the_package(tmp_path):
    """The recipe of docs/architecture.md ("Adding a periodic action"), from this file alone: a
    RunHooks whose add_hooks registers one hook; it runs after the steps it asks for and the last,
    and sees the state of that step."""
    import jax

    from conftest import run_config
    from dalle_ablate.track.runstore import read_metrics
    from dalle_ablate.train.loop import JobInfo, RunHooks, train

    seen = []

    class Probe(RunHooks):
        def add_hooks(self, hooks):
            hooks.add("probe", lambda step, state: seen.append((step, int(jax.device_get(state.step)))), every=4)

    cfg = run_config("tracker=none", "trainer.steps=6", "trainer.eval_every=3")
    res = train(cfg, JobInfo(tmp_path / "job", hooks=Probe()))
    assert res.status == "finished" and seen == [(4, 4), (6, 6)]
    evals = [r["step"] for r in read_metrics(res.run_dir) if "eval/valid/loss" in r]
    assert evals == [3, 6]  # the run's own hooks, unchanged by the caller's


def test_a_callers_hooks_hear_a_members_job_as_they_hear_a_run(tmp_path):
    """The same RunHooks on `seeds=[0,1]` (issue 51): `started` once for each member's run store,
    `should_stop` asked with the mean of the members' validation losses, its own hook given the
    members' stacked state; a stop prunes every member there, each with its checkpoint of that step."""
    import json

    import jax

    from conftest import run_config
    from dalle_ablate.track.runstore import read_metrics
    from dalle_ablate.train.loop import JobInfo, RunHooks, train_members

    started, asked, seen = [], [], []

    class Pruner(RunHooks):
        def add_hooks(self, hooks):
            hooks.add("probe", lambda step, state: seen.append(jax.device_get(state.state.step).tolist()), every=2)

        def started(self, run_dir, processes):
            started.append((run_dir, processes))

        def should_stop(self, eval_loss, step):
            asked.append((step, eval_loss))
            return True

    cfg = run_config("tracker=none", "trainer.steps=6", "trainer.eval_every=3", "seeds=[0,1]", "members.impl=map")
    jobs = [JobInfo(tmp_path / f"seed{s}") for s in (0, 1)]
    results = train_members(cfg, JobInfo(tmp_path, hooks=Pruner()), jobs)
    stores = [tmp_path / f"seed{s}" / "run" for s in (0, 1)]
    assert started == [(store, 1) for store in stores]
    losses = [[r["eval/valid/loss"] for r in read_metrics(store) if "eval/valid/loss" in r] for store in stores]
    assert [len(v) for v in losses] == [1, 1] and losses[0] != losses[1]
    assert asked == [(3, pytest.approx((losses[0][0] + losses[1][0]) / 2, rel=1e-12))]
    assert seen == [[2, 2]]  # step 2's hook saw both members' states at step 2; the job stopped at 3
    assert [(r.status, r.steps) for r in results] == [("pruned", 3)] * 2
    for r, store in zip(results, stores):
        assert r.reason == f"pruned at step 3 of 6 (eval loss {asked[0][1]:.4f})"
        assert json.loads((store / "summary.json").read_text())["status"] == "pruned"
        assert sorted(int(p.name) for p in (store / "checkpoints").iterdir() if p.name.isdigit()) == [3]
