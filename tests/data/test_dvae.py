"""The dVAE image tokenizer (data/dvae.py) and the tokenizer registry: the relaxation, the KL
term, the schedules, shapes, the settings-hash cache, and `dalle-ablate train-tokenizer`."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import run_config
from dalle_ablate.data import dvae
from dalle_ablate.registry import ConfigError


def test_the_relaxation_tends_to_a_one_hot_sample_of_the_softmax_as_tau_falls():
    logits = jnp.asarray([1.0, 0.0, -1.0, 2.0])
    keys = jax.random.split(jax.random.key(0), 20000)
    sample = jax.vmap(dvae.relaxed_sample, in_axes=(0, None, None))
    peaks = []
    for tau in (1.0, 0.25, 1 / 16, 1e-3):
        z = np.asarray(sample(keys, logits, tau))
        assert np.allclose(z.sum(-1), 1.0, atol=1e-5) and (z >= 0).all()  # on the simplex at every τ
        peaks.append(z.max(-1).mean())
    assert peaks == sorted(peaks) and peaks[-1] > 0.999  # sharper as τ falls, one-hot at the end
    # The Gumbel-max trick: the one-hot's position is a sample of softmax(logits).
    p = np.exp([1.0, 0.0, -1.0, 2.0]) / np.exp([1.0, 0.0, -1.0, 2.0]).sum()
    freq = np.bincount(z.argmax(-1), minlength=4) / len(z)
    assert np.abs(freq - p).max() < 4 * np.sqrt(p * (1 - p) / len(z)).max()


def test_kl_to_the_uniform_prior_on_hand_made_logits():
    kl = lambda x: float(dvae.kl_to_uniform(jnp.asarray(x, jnp.float32)))  # noqa: E731
    assert kl([0.0, 0.0, 0.0, 0.0]) == pytest.approx(0.0, abs=1e-6)  # q is the prior
    assert kl([0.0, 0.0, -1e9, -1e9]) == pytest.approx(np.log(2), abs=1e-6)  # half of the codes: log 4 - log 2
    assert kl([100.0, 0.0, 0.0, 0.0]) == pytest.approx(np.log(4), abs=1e-5)  # one code: log K
    x = np.random.default_rng(0).normal(size=(3, 8))
    q = np.exp(x) / np.exp(x).sum(-1, keepdims=True)
    assert np.allclose(dvae.kl_to_uniform(jnp.asarray(x, jnp.float32)), (q * np.log(q * 8)).sum(-1), atol=1e-5)


def test_temperature_and_kl_weight_schedules():
    s = dvae.DVAEConfig(steps=1000, kl_weight=6.6, kl_warmup=0.05, tau_anneal=0.5)
    at = lambda step: [float(v) for v in dvae.schedules(s, jnp.asarray(step, jnp.float32))]  # noqa: E731
    assert at(0) == pytest.approx([1.0, 0.0])
    assert at(50)[1] == pytest.approx(6.6) and at(500)[0] == pytest.approx(1 / 16)
    assert at(1000) == pytest.approx([1 / 16, 6.6])
    taus = [at(i)[0] for i in range(0, 600, 20)]
    assert taus == sorted(taus, reverse=True)


def test_encoder_and_decoder_shapes_and_the_grid():
    assert dvae.groups(8) == 4 and dvae.groups(2) == 2
    with pytest.raises(
        ConfigError,
        match=r"^data.patch_size=6: data.tokenizer=dvae halves the image per group, so it needs a power of 2 >= 2$",
    ):
        dvae.groups(6)
    model = dvae.create(7, 4, dvae.DVAEConfig(width=4))
    images = np.random.default_rng(0).integers(0, 256, (3, 24, 24, 3), dtype=np.uint8)
    tok = dvae.DVAETokenizer(model, (6, 6), batch=2)  # 3 images in batches of 2: the last one padded
    codes = tok.encode(images)
    assert codes.shape == (3, 36) and codes.dtype == np.int32 and codes.min() >= 0 and codes.max() < 7
    out = tok.decode(codes)
    assert out.shape == (3, 24, 24, 3) and out.dtype == np.uint8
    with pytest.raises(ValueError, match=r"codes outside the codebook \[0, 7\)"):
        tok.decode(codes + 7)


def test_each_resblock_branch_enters_with_the_small_gain():
    block = nnx.jit(lambda: dvae.ResBlock(4, 8, gain=1.0, decoder=False, rngs=nnx.Rngs(0)))()
    x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 6, 6, 4)), jnp.float32)
    full = block(x)
    block.gain = 1 / 16
    assert np.allclose(block(x), block.id(x) + (full - block.id(x)) / 16, atol=1e-6)
    # the gain is 1 / L^gain_power for L resblocks per side (patch 4: 3 groups; 2 blocks each: L = 6)
    for power in (0.0, 1.0, 2.0):
        model = dvae.create(16, 4, dvae.DVAEConfig(width=4, blocks=2, gain_power=power), abstract=True)
        assert len(model.enc) == len(model.dec) == 6
        assert {b.gain for b in [*model.enc, *model.dec]} == {6.0**-power}


# 16 px renders on a 4 x 4 grid: three groups to compile, not four, and 16 image tokens.
TINY_DVAE = [
    "data.tokenizer=dvae",
    "data.image_size=16",
    "data.patch_size=4",
    "data.num_train=64",
    "data.num_valid=16",
    "data.num_test=16",
    "data.codebook_size=16",
    "data.dvae.steps=4",
    "data.dvae.width=4",
    "data.dvae.batch=8",
    "tracker=none",
]


@pytest.mark.slow
def test_stage_1_runs_in_a_store_of_its_own_once_per_settings_then_loads_from_the_cache(tmp_path, capsys):
    from conftest import TINY_TRAIN, run_py
    from dalle_ablate.cli import main
    from dalle_ablate.data.image_tokenizer import IMAGE_TOKENIZERS
    from dalle_ablate.data.shapes import ShapesDataset, generate_split, scenes_key

    cache = [f"data.cache_dir={tmp_path / 'cache'}"]
    # python run.py with an uncached dVAE: stage 1 first, in <job>/tokenizer, then the run on its codes
    proc = run_py(*TINY_DVAE, *cache, *TINY_TRAIN, "eval.metrics=[]", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "trained data.tokenizer=dvae in " in proc.stdout
    job = tmp_path / "outputs" / "run"
    summary = json.loads((job / "tokenizer" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["tokenizer/trained"] is True
    assert (
        summary["tokenizer/codebook_size"] == 16
        and summary["tokenizer/grid"] == [4, 4]
        and summary["tokenizer/valid_n"] == 16
    )
    assert 1.0 <= summary["tokenizer/valid_perplexity"] <= summary["tokenizer/codes_used"] <= 16
    assert (
        0.0
        <= summary["tokenizer/parser_all_lo"]
        <= summary["tokenizer/parser_all"]
        <= summary["tokenizer/parser_all_hi"]
        <= 1.0
    )
    rows = [json.loads(x) for x in (job / "tokenizer" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "tokenizer/perplexity" in r] == [4]
    assert list((job / "tokenizer" / "media").glob("tokenizer_reconstructions_*.png"))
    run = json.loads((job / "run" / "summary.json").read_text())
    assert run["status"] == "finished" and run["steps"] == 6
    meta = json.loads((job / "run" / "meta.json").read_text())
    assert meta["data"]["image_vocab"] == 16 and meta["data"]["image_len"] == 16
    (weights,) = (tmp_path / "cache" / "dvae").glob("*.npz")
    # train-tokenizer with the same settings loads it; the dataset's codes are that tokenizer's
    main(["train-tokenizer", *TINY_DVAE, *cache, "--out", str(tmp_path / "tok")])
    out = capsys.readouterr().out
    assert out.startswith("loaded data.tokenizer=dvae in ") and str(weights) in out
    (store,) = (tmp_path / "tok").iterdir()
    assert json.loads((store / "summary.json").read_text())["tokenizer/trained"] is False
    assert weights.name.removesuffix(".npz") in store.name
    cfg = run_config(*TINY_DVAE, *cache, data=())
    ds = ShapesDataset(cfg.data, 24)
    assert np.array_equal(ds.tokenizer.encode(generate_split(cfg.data, "valid")[1]), ds.codes["valid"])
    assert list((tmp_path / "cache" / "dvae").glob("*.npz")) == [weights]
    # any other setting of data.dvae, or of the images, is another tokenizer
    option, scenes = IMAGE_TOKENIZERS.get("dvae"), scenes_key(cfg.data)
    others = [
        run_config(*TINY_DVAE, *cache, o, data=()).data
        for o in ("data.dvae.seed=1", "data.dvae.kl_weight=2", "data.codebook_size=32")
    ]
    keys = {
        option.key(cfg.data, scenes),
        *(option.key(o, scenes) for o in others),
        option.key(cfg.data, scenes_key(run_config(*TINY_DVAE, *cache, "data.num_train=65", data=()).data)),
    }
    assert len(keys) == 5


@pytest.mark.slow
def test_a_diverging_stage_1_stops_like_stage_2_and_caches_nothing(tmp_path):
    """data.dvae.lr=1e4: the dVAE's loss is NaN from step 2; the run stops at the check of step 4
    (its last) with exit 3 and one line, the tokenizer's run store says diverged, stage 2 never
    starts, nothing is cached."""
    from conftest import TINY_TRAIN, run_py
    from dalle_ablate.registry import RunFailed

    proc = run_py(
        *TINY_DVAE,
        f"data.cache_dir={tmp_path / 'cache'}",
        *TINY_TRAIN,
        "data.dvae.lr=1e4",
        "data.dvae.steps=4",
        cwd=tmp_path,
    )
    assert proc.returncode == RunFailed.DIVERGED, proc.stderr[-3000:]
    job = tmp_path / "outputs" / "run"
    rows = [json.loads(x) for x in (job / "tokenizer" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [4] and rows[0]["tokenizer/loss"] == "nan"
    reason = "data.tokenizer=dvae diverged at step 4: tokenizer/loss=nan; no finite loss before it; nothing cached; lower data.dvae.lr"
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {reason}"] and "Traceback" not in proc.stderr
    summary = json.loads((job / "tokenizer" / "summary.json").read_text())
    assert (summary["status"], summary["reason"]) == ("diverged", f"RunFailed: {reason}")
    assert not (tmp_path / "cache" / "dvae").exists() or not list((tmp_path / "cache" / "dvae").iterdir())
    assert not (job / "run" / "metrics.jsonl").exists()  # stage 2 never started


def test_a_cache_entry_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """A write that fails half way (disk full) leaves no entry and no temporary file."""
    import errno
    import os

    model = dvae.create(7, 4, dvae.DVAEConfig(width=4))
    real = np.savez

    def half(file, **arrays):
        real(file, **dict(list(arrays.items())[:1]))  # part of the weights on disk, then the disk is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(np, "savez", half)
    path = tmp_path / "dvae" / "key.npz"
    with pytest.raises(OSError, match="No space left on device"):
        dvae.save(model, path)
    assert list(path.parent.iterdir()) == []
    monkeypatch.undo()
    dvae.save(model, path)
    assert [p.name for p in path.parent.iterdir()] == ["key.npz"]


def test_a_null_codebook_size_is_the_tokenizers_own_default():
    from dalle_ablate.data import abstract_sizes

    def vocab(*overrides):
        cfg = run_config(*overrides, data=())
        return abstract_sizes(cfg.data, cfg.model)["image_vocab"]

    # kmeans: the 145 distinct patches of the 48 px renders; dvae: room for synonyms (data/dvae.py)
    assert (vocab(), vocab("data.tokenizer=dvae"), vocab("data.tokenizer=dvae", "data.codebook_size=64")) == (
        145,
        512,
        64,
    )
    with pytest.raises(
        ConfigError, match=r"^data.tokenizer=vqgan needs data.codebook_size: its VQGAN's codebook size \(n_embed\)$"
    ):
        run_config("data.tokenizer=vqgan", "data.vqgan_path=vqgan.npz", data=())


def test_a_bad_tokenizer_is_named_with_the_valid_ones():
    with pytest.raises(
        ConfigError, match=r"^data.tokenizer='dvea' is not a known image tokenizer; valid: dvae, kmeans, vqgan$"
    ):
        run_config("data.tokenizer=dvea")
    with pytest.raises(ConfigError, match=r"^data.tokenizer=vqgan needs data.vqgan_path"):
        run_config("data.tokenizer=vqgan")
