"""Initialisation keyed by parameter path (model/init_keys.py): arms that share a parameter start it
alike, every parameter draws from its own key, and the keys do not depend on the process."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest
from flax import nnx

from conftest import AS_HERE, ROOT
from dalle_ablate.model import build_model
from test_model import tiny_model_cfg


def params(model) -> dict[tuple, np.ndarray]:
    return {tuple(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


# (layout, the other arm's changes): a sublayer more or less (GLU's gate, NormFormer's extra norms,
# Swin's head scale and tau), or a bias on every dense layer, each adding parameters in the middle
# of the construction order.
ARMS = [
    ("preln", dict(glu=True), dict(glu=False)),
    ("preln", dict(bias=False), dict(bias=True)),
    ("preln", {}, "normformer"),
    ("preln", dict(head_scale=False), dict(head_scale=True)),
]


@pytest.mark.parametrize("layout,a,b", ARMS)
def test_arms_that_share_a_parameter_start_it_from_the_same_values(layout, a, b):
    cfg_a = tiny_model_cfg(layout, **a)
    cfg_b = tiny_model_cfg(b) if isinstance(b, str) else dataclasses.replace(cfg_a, **b)
    pa, pb = params(build_model(cfg_a, 3)), params(build_model(cfg_b, 3))
    shared = [p for p in pa if p in pb and pa[p].shape == pb[p].shape]
    assert set(pa) != set(pb)  # the arms differ in their parameters
    assert len(shared) >= 20
    different = [p for p in shared if not np.array_equal(pa[p], pb[p])]
    assert different == []


def test_each_parameter_draws_its_own_values_and_the_init_seed_moves_them_all():
    cfg = tiny_model_cfg("preln")
    p0, p1 = params(build_model(cfg, 0)), params(build_model(cfg, 1))
    drawn = {p: v for p, v in p0.items() if np.std(v) > 0}  # kernels and embeddings (norms start at 1, biases at 0)
    assert len(drawn) >= 20
    assert len({v.tobytes() for v in drawn.values()}) == len(drawn)  # no two share a key, same shapes included
    assert all(not np.array_equal(v, p1[p]) for p, v in drawn.items())
    assert all(np.array_equal(v, params(build_model(cfg, 0))[p]) for p, v in p0.items())  # determinism


def digest(cfg, seed) -> str:
    h = hashlib.sha256()
    for p, v in sorted(params(build_model(cfg, seed)).items()):
        h.update(repr(p).encode() + v.tobytes())
    return h.hexdigest()


def test_the_keys_do_not_depend_on_the_process():
    """Path hashes are blake2b, not Python's salted `hash`: another process, another hash seed, the
    same parameters."""
    code = (
        "import sys; sys.path[:0] = ['tests', 'tests/model']; from test_model import tiny_model_cfg; "
        "from test_init_keys import digest; print(digest(tiny_model_cfg('preln'), 5))"
    )
    env = {**os.environ, **AS_HERE, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == digest(tiny_model_cfg("preln"), 5)
