"""Training: the loss goes down, runs are reproducible, accumulation is exact, resume continues."""

from __future__ import annotations

import dataclasses
import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import run_config
from dalle_ablate.config import data_seed
from dalle_ablate.model import build_model, resolve
from dalle_ablate.optim import build_optimizer
from dalle_ablate.track.runstore import read_metrics
from dalle_ablate.train.gradients import GradientOptions
from dalle_ablate.train.loop import JobInfo, train
from dalle_ablate.train.state import TrainState
from dalle_ablate.train.step import make_train_step


def setup(small_dataset, *overrides, batch_size=8):
    cfg = run_config("tracker=none", *overrides)
    ds = small_dataset
    mcfg = resolve(cfg.model, ds.image_len, ds.image_vocab, ds.text.vocab_size)
    graphdef, params = nnx.split(build_model(mcfg, cfg.seed), nnx.Param)
    params = nnx.to_pure_dict(params)
    batch = ds.split_batch("train", np.arange(batch_size))
    return cfg, graphdef, params, batch


def fresh_state(cfg, params):
    opt, sched = build_optimizer(cfg.optim, cfg.schedule, cfg.trainer.steps)
    return (
        opt,
        sched,
        TrainState(step=jnp.zeros((), jnp.int32), params=jax.tree.map(jnp.copy, params), opt_state=opt.init(params)),
    )


@pytest.mark.parametrize("optim", ["adam", "adafactor"])
def test_a_few_steps_on_a_fixed_batch_lower_the_loss(small_dataset, optim):
    cfg, graphdef, params, batch = setup(
        small_dataset, f"optim={optim}", "optim.lr=3e-3", "schedule=constant", "schedule.warmup_steps=0"
    )
    opt, sched, state = fresh_state(cfg, params)
    step = make_train_step(graphdef, opt, sched, GradientOptions.of(cfg))
    losses = []
    for _ in range(30):
        state, m = step(state, batch)
        losses.append(float(m["train/loss"]))
    assert losses[0] == pytest.approx(np.log(small_dataset.image_vocab), rel=0.05)  # uniform at init
    assert losses[-1] < 0.6 * losses[0]


def test_grad_accumulation_equals_the_full_batch(small_dataset):
    cfg, graphdef, params, batch = setup(small_dataset, "optim.clip_grad_norm=null", batch_size=8)
    results = []
    for accum in (1, 4):
        opt, sched, state = fresh_state(cfg, params)
        options = dataclasses.replace(GradientOptions.of(cfg), grad_accum=accum)
        state, m = make_train_step(graphdef, opt, sched, options)(state, batch)
        results.append((float(m["train/loss"]), float(m["train/grad_norm"]), state.params))
    (l1, g1, p1), (l4, g4, p4) = results
    assert l4 == pytest.approx(l1, rel=1e-5) and g4 == pytest.approx(g1, rel=1e-4)
    assert all(np.allclose(a, b, atol=1e-6) for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p4)))


def test_a_gradient_stage_registered_from_a_test_file_joins_the_path(small_dataset, monkeypatch, tmp_path):
    """docs/architecture.md's recipe for a stage from outside the package: registered here, on
    where the run's config says (seed 7, here), its gradient is what the optimizer applies, its
    metric is logged and the run's meta.json names it; elsewhere the path is as before."""
    from dalle_ablate.registry import Registry
    from dalle_ablate.train import gradients

    monkeypatch.setattr(gradients, "STAGES", Registry("gradient stage", "gradient path"))

    @gradients.gradient_stage("scaled", lambda cfg: 0.0 if cfg.seed == 7 else None)
    def scaled(path, factor):
        def stage(state, batch, total_weight, key):
            g = path(state, batch, total_weight, key)
            return g._replace(
                grads=jax.tree.map(lambda x: factor * x, g.grads),
                metrics={**g.metrics, "train/toy_factor": jnp.float32(factor)},
            )

        return stage

    for seed, on in ((7, True), (0, False)):
        cfg, graphdef, params, batch = setup(
            small_dataset, f"seed={seed}", "optim.weight_decay=0", "schedule=constant", "schedule.warmup_steps=0"
        )
        options = GradientOptions.of(cfg)
        assert options.added == ((("scaled", 0.0),) if on else ())
        opt, sched, state = fresh_state(cfg, params)
        state, m = make_train_step(graphdef, opt, sched, options)(state, batch)
        same = [np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(state.params))]
        assert float(m["train/loss"]) > 0
        if on:  # a zero gradient: Adam moves nothing
            assert all(same) and float(m["train/grad_norm"]) == 0 and float(m["train/toy_factor"]) == 0
        else:
            assert not all(same) and float(m["train/grad_norm"]) > 0 and "train/toy_factor" not in m
    on, off = (train(run_config("tracker=none", f"seed={seed}"), JobInfo(tmp_path / str(seed))) for seed in (7, 0))
    assert json.loads((on.run_dir / "meta.json").read_text())["gradient_stages"] == ["scaled"]
    assert "gradient_stages" not in json.loads((off.run_dir / "meta.json").read_text())


def test_the_step_core_over_a_member_axis_equals_each_seeds_own_step(small_dataset):
    """Issue 40's ground: two seeds' states, batches and dropout keys stacked on a member axis;
    `lax.map` of the step core gives each member its own step (the unbatched program: exactly, on
    the CPU; XLA does not promise it for two programs elsewhere), `vmap` the same within float32
    reassociation."""
    from dalle_ablate.train.step import train_step_core

    members = []
    for seed in (0, 1):
        cfg, graphdef, params, _ = setup(small_dataset, f"seed={seed}", "model.dropout=0.1")
        opt, sched, state = fresh_state(cfg, params)
        batch = small_dataset.split_batch("train", np.arange(8 * seed, 8 * seed + 8))
        members.append((state, batch, jax.random.fold_in(jax.random.key(seed), 2)))
    core = train_step_core(graphdef, opt, sched, GradientOptions.of(cfg))
    own = [jax.jit(core)(*m) for m in members]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *members)
    mapped = jax.jit(lambda s, b, k: jax.lax.map(lambda a: core(*a), (s, b, k)))(*stacked)
    batched = jax.jit(jax.vmap(core))(*stacked)
    exact = 0.0 if jax.default_backend() == "cpu" else 1e-6
    assert own[0][1]["train/loss"] != own[1][1]["train/loss"]  # two members, not one twice
    for i, (state, metrics) in enumerate(own):
        for key in ("train/loss", "train/grad_norm"):
            assert float(mapped[1][key][i]) == pytest.approx(float(metrics[key]), rel=exact, abs=0)
            assert float(batched[1][key][i]) == pytest.approx(float(metrics[key]), rel=1e-5)
        for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(mapped[0].params)):
            np.testing.assert_allclose(np.asarray(b[i]), np.asarray(a), rtol=exact, atol=0)


def test_per_layer_norms_compose_to_the_global_norm(small_dataset):
    cfg, graphdef, params, batch = setup(small_dataset)
    opt, sched, state = fresh_state(cfg, params)
    _, m = make_train_step(graphdef, opt, sched, GradientOptions.of(cfg))(state, batch)
    layers = {k: float(v) for k, v in m.items() if k.startswith("train/grad_norm/")}
    assert {"train/grad_norm/encoder/0", "train/grad_norm/decoder/1", "train/grad_norm/lm_head"} <= set(layers)
    assert np.sqrt(sum(v**2 for v in layers.values())) == pytest.approx(float(m["train/grad_norm"]), rel=1e-5)


def losses(run_dir):
    return {r["step"]: r["train/loss"] for r in read_metrics(run_dir) if "train/loss" in r}


def test_same_seed_same_losses_and_a_different_seed_differs(tmp_path, small_dataset):
    cfg = run_config("tracker=none")
    a = train(cfg, JobInfo(tmp_path / "a"))
    b = train(cfg, JobInfo(tmp_path / "b"))
    c = train(dataclasses.replace(cfg, seed=1), JobInfo(tmp_path / "c"))
    assert losses(a.run_dir) == losses(b.run_dir)
    assert losses(a.run_dir) != losses(c.run_dir)
    assert a.eval_loss == b.eval_loss and np.isfinite(a.eval_loss)


def test_data_seed_moves_the_data_order_and_init_seed_the_parameters(tmp_path, small_dataset):
    """seed sets both; data_seed and init_seed each override one source (config.py). With no
    dropout nothing else the loss sees follows `seed`, so seed=1 with both sources pinned to 0 trains
    exactly as seed=0."""
    from dalle_ablate.train.assembly import assemble

    cfg = run_config("tracker=none")
    init = lambda c: jax.tree.leaves(assemble(c, dataset=small_dataset).init_state().params)  # noqa: E731
    same = lambda x, y: all(np.array_equal(a, b) for a, b in zip(x, y))  # noqa: E731
    p0 = init(cfg)
    assert same(p0, init(dataclasses.replace(cfg, data_seed=1)))  # the data seed leaves the parameters
    assert same(p0, init(dataclasses.replace(cfg, seed=1, init_seed=0)))
    assert not any(
        np.array_equal(a, b) for a, b in zip(p0, init(dataclasses.replace(cfg, init_seed=1))) if np.std(a) > 0
    )
    first = lambda c: [b["codes"] for b in itertools.islice(small_dataset.train_batches(8, data_seed(c)), 3)]  # noqa: E731
    assert same(first(cfg), first(dataclasses.replace(cfg, init_seed=1)))  # the init seed leaves the data order
    assert not same(first(cfg), first(dataclasses.replace(cfg, data_seed=1)))
    a = train(cfg, JobInfo(tmp_path / "a"))
    pinned = train(dataclasses.replace(cfg, seed=1, data_seed=0, init_seed=0), JobInfo(tmp_path / "pinned"))
    assert losses(pinned.run_dir) == losses(a.run_dir)  # the loop reads both seeds where they belong


def test_resume_auto_continues_step_data_and_rng(tmp_path, small_dataset):
    # 6 steps, a checkpoint every 3; a constant rate, so that the 3-step run takes the same steps
    cfg = run_config("tracker=none", "schedule=constant")
    full = train(cfg, JobInfo(tmp_path / "full"))
    half = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, steps=3))
    train(half, JobInfo(tmp_path / "resumed"))
    assert (tmp_path / "resumed/run/checkpoints/3").is_dir()
    resumed = train(dataclasses.replace(cfg, resume="auto"), JobInfo(tmp_path / "resumed"))
    assert resumed.steps == 6
    assert losses(resumed.run_dir) == pytest.approx(losses(full.run_dir), rel=1e-6)
    steps = [r["step"] for r in read_metrics(resumed.run_dir) if "train/loss" in r]
    assert steps == sorted(set(steps)) == list(range(1, 7))
    meta = json.loads((resumed.run_dir / "meta.json").read_text())
    assert meta["resumed_from_step"] == 3
    # Finished: resume=auto leaves it as it is (a rerun study skips it), unless more steps are asked.
    files = {p: p.read_bytes() for p in resumed.run_dir.rglob("*") if p.is_file()}
    again = train(dataclasses.replace(cfg, resume="auto"), JobInfo(tmp_path / "resumed"))
    assert again.status == "finished" and again.steps == 6 and again.eval_loss == resumed.eval_loss
    assert {p: p.read_bytes() for p in resumed.run_dir.rglob("*") if p.is_file()} == files
    longer = train(
        dataclasses.replace(cfg, resume="auto", trainer=dataclasses.replace(cfg.trainer, steps=7)),
        JobInfo(tmp_path / "resumed"),
    )
    assert longer.steps == 7 and max(losses(longer.run_dir)) == 7
    # And from a path: a new job dir restoring another run's checkpoints.
    other = train(
        dataclasses.replace(cfg, resume=str(tmp_path / "full" / "run" / "checkpoints" / "3")),
        JobInfo(tmp_path / "other"),
    )
    assert losses(other.run_dir) == pytest.approx({k: v for k, v in losses(full.run_dir).items() if k > 3}, rel=1e-6)


def test_run_store_records_config_meta_metrics_and_samples(tmp_path, small_dataset):
    cfg = run_config("tracker=none")
    res = train(cfg, JobInfo(tmp_path, overrides=["model=preln"]))
    store = res.run_dir
    import yaml

    config = yaml.safe_load((store / "config.yaml").read_text())
    assert config["model"]["layout"] == "preln" and config["trainer"]["steps"] == 6  # nested, resolved
    meta = json.loads((store / "meta.json").read_text())
    assert meta["overrides"] == ["model=preln"] and meta["params"] > 0 and meta["flops_per_step"] > 0
    assert {"jax", "flax", "optax", "wandb"} <= set(meta["versions"]) and meta["device"]["kind"]
    rows = read_metrics(store)
    names = set().union(*rows)
    for name in (
        "train/loss",
        "train/grad_norm",
        "train/param_norm",
        "train/lr",
        "eval/valid/loss",
        "perf/step_time",
        "perf/tokens_per_s",
        "perf/mfu",
        "samples",
        "tokens",
        "train/grad_norm/decoder/0",
        "train/param_norm/encoder/0",
    ):
        assert name in names, name
    per_layer_steps = [r["step"] for r in rows if "train/grad_norm/decoder/0" in r]
    assert per_layer_steps == [2, 4, 6]  # every trainer.log_every=2 steps
    assert [r["step"] for r in rows if "eval/valid/loss" in r] == [3, 6]
    assert (store / "media" / "samples_grid_6.png").is_file()
    summary = json.loads((store / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps"] == 6


def test_a_diverging_run_stops_and_is_marked(tmp_path, small_dataset):
    # A learning rate of 1e9 without clipping throws the weights to infinity within a step or two.
    cfg = run_config(
        "tracker=none",
        "optim.lr=1e9",
        "optim.clip_grad_norm=null",
        "schedule=constant",
        "schedule.warmup_steps=0",
        "trainer.steps=20",
        "trainer.save_every=1",
        "trainer.eval_every=100",
    )
    res = train(cfg, JobInfo(tmp_path))
    assert res.status == "diverged" and res.steps < 20
    assert not np.isfinite(res.train_loss)
    summary = json.loads((res.run_dir / "summary.json").read_text())
    assert summary["status"] == "diverged"
    # Checkpoints were saved every step, but never one of a broken state.
    from dalle_ablate.train import checkpoint

    ckpt_dir, _ = checkpoint.find_checkpoints(str(tmp_path))
    steps = sorted(int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit())
    assert steps and steps[-1] < res.steps
    ds = small_dataset
    mcfg = resolve(cfg.model, ds.image_len, ds.image_vocab, ds.text.vocab_size)
    params = nnx.to_pure_dict(nnx.split(build_model(mcfg, 0), nnx.Param)[1])
    opt, _, target = fresh_state(cfg, params)
    _, restored = checkpoint.restore(ckpt_dir, None, target)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(restored.params))
    # resume=auto leaves it as it is (retrained, it would diverge at the same step again), as a
    # member's: the same Result, nothing retrained or logged again, and the job's line the same
    from dalle_ablate.job import outcome
    from dalle_ablate.registry import RunFailed

    logged = (res.run_dir / "metrics.jsonl").read_bytes()
    again = train(dataclasses.replace(cfg, resume="auto"), JobInfo(tmp_path))
    assert (again.status, again.steps, again.reason) == (res.status, res.steps, res.reason)
    assert (res.run_dir / "metrics.jsonl").read_bytes() == logged
    lines = []
    for r in (res, again):
        with pytest.raises(RunFailed) as err:
            outcome(cfg, JobInfo(tmp_path, name="lr1e9"), [r])
        lines.append((str(err.value), err.value.exit_code))
    assert lines[0] == lines[1] == (f"lr1e9: {res.reason} (run store {res.run_dir})", RunFailed.DIVERGED)


class _DueAt:
    """Hooks due after the steps given (the loop asks nothing else of them to plan its dispatches)."""

    def __init__(self, *steps: int):
        self.steps = set(steps)

    def due(self, step: int) -> tuple:
        return ("hook",) if step in self.steps else ()


@pytest.mark.parametrize("per, start, due", [(1, 1, (3,)), (4, 1, (3, 6)), (5, 7, (9, 20)), (3, 2, ())])
def test_dispatches_cover_every_step_once_and_end_where_a_hook_is_due(per, start, due):
    from dalle_ablate.train.loop import dispatches

    steps = range(start, 21)
    got = list(dispatches(steps, per, _DueAt(*due)))
    assert [s for a, b in got for s in range(a, b + 1)] == list(steps)  # each step once, in order
    assert all(1 <= b - a + 1 <= per for a, b in got)
    ends = {b for _, b in got}
    assert set(due) & set(steps) <= ends  # a hook runs after the whole step it is due at
    # Otherwise a dispatch ends only where `per` divides its last step (or the run ends there).
    assert all(b % per == 0 or b in due or b == steps.stop - 1 for b in ends)


def test_several_steps_per_dispatch_train_the_same_run_bit_for_bit(tmp_path, small_dataset):
    # 7 steps with a validation and a checkpoint every 3: dispatches of 3 (compiled), 1, 2 and 1 steps.
    cfg = run_config("tracker=none", "trainer.steps=7")
    one = train(cfg, JobInfo(tmp_path / "one"))
    four = train(
        dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, steps_per_dispatch=4)),
        JobInfo(tmp_path / "four"),
    )
    numbers = lambda run: [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in read_metrics(run.run_dir)]  # noqa: E731
    assert numbers(four) == numbers(one) and four.eval_loss == one.eval_loss
    assert sorted(p.name for p in (tmp_path / "four/run/checkpoints").iterdir()) == ["6", "7"]
    timed = {r["step"]: r["perf/step_time"] for r in read_metrics(four.run_dir) if "perf/step_time" in r}
    assert sorted(timed) == [4, 5, 6, 7] and all(t > 0 for t in timed.values())  # steps 1-3: their dispatch compiled
    assert timed[5] == timed[6]  # one dispatch, each step its share
