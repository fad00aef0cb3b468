"""Options registered once, beside their builder (registry.py): a toy optimizer defined in this file
alone is chosen with `optim=`, checked by its own ranges and `validate` before anything is built,
and trains; registries refuse a schema that names another option and a preset of another option."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from conftest import SMALL_DATA, TINY_TRAIN, compose

from dalle_ablate.optim import OPTIMIZERS, OptimConfig
from dalle_ablate.registry import ConfigError, Registry, check
from dalle_ablate.validate import to_run_config


# -- the toy optimizer: the steps docs/architecture.md ("Adding an option") lists ---------------
@dataclass
class SignSGDConfig(OptimConfig):
    RANGES = {"lr": "(0, 1]"}

    name: str = "toy_signsgd"
    lr: float = 0.01
    flip: bool = False  # step along +sign(g), uphill: only to test that validate() runs

    def validate(self, run) -> None:
        super().validate(run)
        check(not self.flip, "optim.flip=true makes toy_signsgd climb the loss")


@OPTIMIZERS.option("toy_signsgd", SignSGDConfig)
def toy_signsgd(cfg: SignSGDConfig, lr, stack_sharding) -> optax.GradientTransformation:
    # signSGD (Bernstein et al. 2018, arXiv 1802.04434): every coordinate moves by exactly lr.
    return optax.chain(optax.scale_by_sign(), optax.scale_by_learning_rate(lr))


PRESET = "defaults:\n  - /schema/optim_toy_signsgd@_here_\n  - _self_\nlr: 0.001\n"


@pytest.fixture()
def conf_dir(tmp_path: Path) -> Path:
    """A config folder of the user's own, with the toy's preset, added to Hydra's search path."""
    (tmp_path / "optim").mkdir()
    (tmp_path / "optim" / "toy_signsgd.yaml").write_text(PRESET)
    return tmp_path


def toy_config(conf_dir: Path, *overrides: str):
    return to_run_config(
        compose(
            f"hydra.searchpath=[file://{conf_dir}]",
            *SMALL_DATA,
            *TINY_TRAIN,
            "optim=toy_signsgd",
            "schedule=constant",
            "schedule.warmup_steps=0",
            "optim.clip_grad_norm=null",
            *overrides,
        )
    )


def test_a_toy_optimizer_from_this_file_is_composed_validated_and_trains(conf_dir):
    from dalle_ablate.train.assembly import assemble

    cfg = toy_config(conf_dir)
    assert isinstance(cfg.optim, SignSGDConfig) and cfg.optim.lr == 0.001  # the preset's value over the schema's
    run = assemble(cfg, sizes={"image_len": 9, "image_vocab": 20, "text_vocab": 30}, devices=jax.devices()[:1])
    m = run.model_cfg
    rng = np.random.default_rng(0)
    b = cfg.trainer.batch_size
    batch = {
        "text": rng.integers(4, m.text_vocab, (b, m.text_len)).astype(np.int32),
        "text_mask": np.ones((b, m.text_len), bool),
        "codes": rng.integers(0, m.image_vocab, (b, m.image_len)).astype(np.int32),
        "weights": np.ones(b, np.float32),
    }
    state, step = run.init_state(), run.train_step()
    state, _ = step(state, run.placement.global_batch(batch, b))
    before = jax.tree.map(np.asarray, state.params)
    state, metrics = step(state, run.placement.global_batch({**batch, "codes": np.roll(batch["codes"], 1, axis=0)}, b))
    assert np.isfinite(float(metrics["train/loss"]))
    moved = np.concatenate(
        [np.abs(np.asarray(a) - p).ravel() for a, p in zip(jax.tree.leaves(state.params), jax.tree.leaves(before))]
    )
    # signSGD moves every coordinate with a nonzero gradient by exactly lr, at every step. (At the
    # first step Adam would too, lr * g / |g|, so this is the second; Adam's would vary.)
    touched = moved[moved > 0]
    assert touched.size > 0.5 * moved.size
    np.testing.assert_allclose(touched, 0.001, rtol=1e-3)


def test_the_toy_optimizers_own_checks_run_before_anything_is_built(conf_dir):
    with pytest.raises(ConfigError, match=r"^optim.lr=2.0 must be in \(0, 1\]$"):
        toy_config(conf_dir, "optim.lr=2")
    with pytest.raises(ConfigError, match="^optim.flip=true makes toy_signsgd climb the loss$"):
        toy_config(conf_dir, "optim.flip=true")
    with pytest.raises(ConfigError, match=r"^optim.weight_decay=-1.0 must be in \[0, inf\)$"):  # the base class's range
        toy_config(conf_dir, "optim.weight_decay=-1")


def test_a_preset_of_one_option_cannot_build_another():
    with pytest.raises(
        ConfigError,
        match=r"^optim.name='shampoo' does not match the optim preset chosen \(AdamConfig\); "
        r"choose the option itself with optim=shampoo$",
    ):
        to_run_config(compose(*SMALL_DATA, *TINY_TRAIN, "optim=adam", "optim.name=shampoo"))


def test_a_schema_must_default_to_its_option_name():
    registry = Registry("toy", "toy")

    @dataclass
    class Named(OptimConfig):
        name: str = "other"

    with pytest.raises(ValueError, match=r"^Named.name defaults to 'other', not to its option name 'toy'$"):
        registry.option("toy", Named)
    registry.option("other", Named)(lambda cfg: None)
    with pytest.raises(ValueError, match="^toy 'other' registered twice$"):
        registry.option("other", Named)(lambda cfg: None)


def test_each_evaluator_with_settings_has_them_typed_at_eval_name():
    # An evaluator that registers settings must find them at eval.<name> with that type, or its
    # checks and setup would read some other section.
    from dalle_ablate.evaluate import EVALUATORS, EvalConfig

    e = EvalConfig()
    with_settings = [n for n in EVALUATORS.names() if EVALUATORS.get(n).settings is not None]
    assert with_settings == ["clip", "fid"]
    for name in with_settings:
        assert type(e.settings(name)) is EVALUATORS.get(name).settings
    assert e.settings("shapes") is None
