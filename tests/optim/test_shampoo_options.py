"""Each Shampoo option is listed once, in `ShampooOptions` (optim/scale_by_shampoo.py): the config
optim=shampoo takes its fields from there, the preset sets none of them, and a toy option defined
in this file alone is composed with `optim.<name>=`, range-checked and reaches the record the
transformation reads (docs/architecture.md, "How to add a Shampoo option")."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import yaml
from conftest import SMALL_DATA, TINY_TRAIN, compose, run_config

import dalle_ablate
from dalle_ablate.optim import OPTIMIZERS, build_optimizer
from dalle_ablate.optim.scale_by_shampoo import ShampooOptions, scale_by_shampoo
from dalle_ablate.optim.shampoo import ShampooConfig, shampoo, with_options
from dalle_ablate.registry import ConfigError
from dalle_ablate.validate import to_run_config


def test_the_config_holds_every_option_with_its_default_and_the_preset_sets_none():
    config = {f.name: f for f in dataclasses.fields(ShampooConfig)}
    for f in dataclasses.fields(ShampooOptions):
        assert config[f.name].default == f.default, f.name
    preset = yaml.safe_load((Path(dalle_ablate.__file__).parent / "conf/optim/shampoo.yaml").read_text())
    assert list(preset) == ["defaults"]
    cfg = run_config("optim=shampoo").optim
    assert cfg.options() == ShampooOptions() and cfg.lr == 1e-3 and cfg.lapack_threads == 1


def test_the_reference_names_and_the_config_names_give_one_record():
    # distributed_shampoo's beta1/beta2/graft_beta2 are optim.b1/b2/graft_b2: one option each.
    with pytest.raises(ConfigError, match=r"^optim.b1=1.0 must be in \[0, 1\)$"):
        scale_by_shampoo(beta1=1.0)
    with pytest.raises(ConfigError, match="^optim.graft='lion' is not valid; valid: adagrad, adam, rmsprop, "):
        scale_by_shampoo(graft="lion")
    params = {"w": jnp.zeros((6, 5))}
    g = {"w": jnp.asarray(np.random.default_rng(0).normal(size=(6, 5)), jnp.float32)}
    a = scale_by_shampoo(block_size=8, beta1=0.5, beta2=0.9, graft_beta2=0.8, start_preconditioning_step=0)
    b = scale_by_shampoo(ShampooOptions(block_size=8, b1=0.5, b2=0.9, graft_b2=0.8, start_preconditioning_step=0))
    ua, _ = a.update(g, a.init(params))
    ub, _ = b.update(g, b.init(params))
    assert np.array_equal(np.asarray(ua["w"]), np.asarray(ub["w"]))
    assert float(jnp.abs(ua["w"]).max()) > 0


# -- a toy option: the recipe's steps, from this file alone -------------------------------------
@dataclass(frozen=True)
class CappedOptions(ShampooOptions):
    RANGES: ClassVar[dict[str, str]] = {**ShampooOptions.RANGES, "max_update": "(0, inf) or null"}

    max_update: Optional[float] = None  # each element of the update clipped to +-max_update; null = off


@dataclass
@with_options(CappedOptions)
class CappedShampooConfig(ShampooConfig):
    name: str = "toy_capped_shampoo"


@OPTIMIZERS.option("toy_capped_shampoo", CappedShampooConfig)
def toy_capped_shampoo(cfg: CappedShampooConfig, lr, stack_sharding) -> optax.GradientTransformation:
    tx = shampoo(cfg, lr, stack_sharding)
    cap = cfg.options().max_update
    return tx if cap is None else optax.chain(tx, optax.clip(cap))


@pytest.fixture()
def conf_dir(tmp_path: Path) -> Path:
    (tmp_path / "optim").mkdir()
    (tmp_path / "optim" / "toy_capped_shampoo.yaml").write_text(
        "defaults:\n  - /schema/optim_toy_capped_shampoo@_here_\n  - _self_\n"
    )
    return tmp_path


def toy_config(conf_dir: Path, *overrides: str):
    return to_run_config(
        compose(
            f"hydra.searchpath=[file://{conf_dir}]",
            *SMALL_DATA,
            *TINY_TRAIN,
            "optim=toy_capped_shampoo",
            "schedule=constant",
            "schedule.warmup_steps=0",
            *overrides,
        )
    )


def test_a_toy_option_from_this_file_is_composed_checked_and_reaches_the_record(conf_dir):
    cfg = toy_config(conf_dir, "optim.max_update=1e-5", "optim.block_size=16")
    record = cfg.optim.options()
    assert type(record) is CappedOptions and record.max_update == 1e-5 and record.block_size == 16
    assert dataclasses.replace(record, max_update=None, block_size=1024) == CappedOptions()  # the rest: defaults
    with pytest.raises(ConfigError, match=r"^optim.max_update=0.0 must be in \(0, inf\) or null$"):
        toy_config(conf_dir, "optim.max_update=0")

    params = {"w": jnp.zeros((24, 20)), "b": jnp.zeros((20,))}
    rng = np.random.default_rng(0)
    g = {k: jnp.asarray(rng.normal(size=v.shape), jnp.float32) for k, v in params.items()}

    def first_update(optim_cfg):
        opt, _ = build_optimizer(optim_cfg, cfg.schedule, 10)
        u, _ = jax.jit(opt.update)(g, opt.init(params), params)
        return np.concatenate([np.asarray(x).ravel() for x in jax.tree.leaves(u)])

    capped, plain = first_update(cfg.optim), first_update(toy_config(conf_dir, "optim.block_size=16").optim)
    assert np.abs(plain).max() > 1e-5  # so the cap binds
    np.testing.assert_array_equal(capped, np.clip(plain, -1e-5, 1e-5))
