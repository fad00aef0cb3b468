"""Best-of-N reranking: the pick is the scorer's favourite among each prompt's first k draws,
best-of-N never scores below best-of-1 under its own scorer, the evaluators see the picked
images; the contrastive shapes scorer is seeded, cached by its settings, and retrieves held-out
pairs far above chance."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from conftest import run_config
from dalle_ablate.evaluate.contrastive import ContrastiveScorer, ScorerConfig, hard_negative, words
from dalle_ablate.evaluate.evaluators import Evaluator
from dalle_ablate.evaluate.rerank import best_of_ks, pick_best, rerank_rows
from dalle_ablate.registry import ConfigError


def test_best_of_ks_double_up_to_n():
    assert best_of_ks(1) == [1] and best_of_ks(8) == [1, 2, 4, 8] and best_of_ks(6) == [1, 2, 4, 6]


def test_pick_best_is_the_argmax_of_the_first_k_draws():
    scores = np.array([[0.1, 0.9, 0.5, 2.0], [3.0, 1.0, 4.0, 0.0]])
    assert pick_best(scores, 1).tolist() == [0, 0]
    assert pick_best(scores, 2).tolist() == [1, 0]
    assert pick_best(scores, 4).tolist() == [3, 2]


class FakeContext:
    """What rerank_rows reads of an Evaluation: draws whose "image" is its own index, a scorer of
    fixed random scores, and one `samples` evaluator that reports the mean picked index."""

    def __init__(self, prompts: int, n: int, seed: int = 0):
        self.e = SimpleNamespace(rerank=n)
        self.prompts = [f"p{i}" for i in range(prompts)]
        self.table = np.random.default_rng(seed).normal(size=(prompts, n))
        self.dataset = SimpleNamespace(decode_images=lambda codes: codes.astype(np.float64))
        self.cache = {
            "rerank": SimpleNamespace(scores=lambda images, texts: self.table.reshape(-1)[images[:, 0].astype(int)])
        }
        self.evaluators = {
            "probe": Evaluator("samples", lambda images, ctx: {"mean_index": float(images[:, 0].mean())})
        }
        self.seen = []

    def sample(self, prompts, scale, repeats=1):
        assert prompts == self.prompts and repeats == self.e.rerank
        return np.arange(len(prompts) * repeats)[:, None]  # prompt-major: draw j of prompt i is i * n + j


def test_rerank_rows_pick_the_scorers_favourite_and_never_score_below_best_of_one():
    ctx = FakeContext(prompts=50, n=8)
    rows = rerank_rows(ctx, 3.0, "run", 5)
    assert [r["best_of"] for r in rows] == [1, 2, 4, 8] and all(r["scale"] == 3.0 and r["n"] == 50 for r in rows)
    for r in rows:
        k = r["best_of"]
        best = ctx.table[:, :k].argmax(1)
        assert r["rerank/score"] == pytest.approx(ctx.table[np.arange(50), best].mean())
        assert r["probe/mean_index"] == pytest.approx((np.arange(50) * 8 + best).mean())  # the evaluator saw the picks
    scores = [r["rerank/score"] for r in rows]
    assert scores == sorted(scores) and scores[-1] > scores[0]


def test_hard_negatives_swap_two_colours_or_change_one_word():
    rng = np.random.default_rng(0)
    caption = "a red circle to the left of a blue square"
    seen = {hard_negative(caption, rng) for _ in range(200)}
    assert "a blue circle to the left of a red square" in seen
    for neg in seen:
        diff = [(a, b) for a, b in zip(words(caption), words(neg)) if a != b]
        assert len(words(neg)) == len(words(caption)) and 1 <= len(diff) <= 2, neg


def test_the_contrastive_scorer_is_seeded_cached_and_retrieves_held_out_pairs(tmp_path):
    settings = ScorerConfig(steps=120, train_images=2000, batch=64, held_out=256)
    first = ContrastiveScorer(tmp_path, settings)
    assert first.trained and first.path == tmp_path / "scorer" / f"{settings.digest()}.npz"
    r = first.retrieval
    assert r["pairs"] == 256 and r["group"] == 64
    assert r["text_to_image"] > 0.25 and r["image_to_text"] > 0.25, r  # chance is 1/64
    again = ContrastiveScorer(tmp_path, settings)  # from the cache: the same network
    assert not again.trained and again.retrieval == r
    from dalle_ablate.evaluate.contrastive import scene_pairs

    images, captions = scene_pairs(16, 99)
    np.testing.assert_allclose(first.scores(images, captions), again.scores(images, captions), rtol=1e-6)
    assert (
        ScorerConfig(seed=1).digest()
        != settings.digest()
        != ScorerConfig(steps=121, train_images=2000, batch=64, held_out=256).digest()
    )


def test_rerank_config_errors_name_the_field():
    with pytest.raises(ConfigError, match=r"^eval.rerank=0 must be in \[1, inf\)"):
        run_config("eval.rerank=0")
    with pytest.raises(
        ConfigError, match=r"^eval.rerank_scorer='blip' is not a known scorer; valid: clip, contrastive"
    ):
        run_config("eval.rerank=4", "eval.rerank_scorer=blip")
    with pytest.raises(ConfigError, match=r"^eval.rerank_scorer=clip but eval.clip.weights is not set"):
        run_config("eval.rerank=4", "eval.rerank_scorer=clip")
    with pytest.raises(ConfigError, match=r"^eval.scorer.batch=1 must be in \[2, inf\)"):
        run_config("eval.rerank=4", "eval.scorer.batch=1")
