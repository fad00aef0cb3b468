"""One evaluation of a model at a step: for each guidance scale, samples of the eval prompts
(the same prompts and the same noise at every scale and every step) scored by the `samples`
evaluators -> one Pareto row per scale; the `model` evaluators once; the prompt grids. Everything
goes to the tracker: scalars, a table with a line chart, a PNG of the Pareto curve, grid images
and a table of them."""

from __future__ import annotations

import copy
import io
import math
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from dalle_ablate import interrupts
from dalle_ablate.evaluate.evaluators import EVALUATORS
from dalle_ablate.evaluate.prompts import PROMPT_LISTS, by_category, slug
from dalle_ablate.evaluate.rerank import SCORERS, rerank_rows
from dalle_ablate.generate import image_grid, make_sampler
from dalle_ablate.metrics import headlines, pareto_axes
from dalle_ablate.model import token_nll


def number(v: float, spec: str) -> str:
    """`v` formatted by `spec`, without the sign of a negative zero (-0.001 at .2f is 0.00)."""
    text = format(v, spec)
    return text[1:] if text.startswith("-") and not any(c in "123456789" for c in text.split("e")[0]) else text


def headline(result: dict) -> list[str]:
    """Console lines of one evaluation (`Evaluation.run`'s result): each sampled headline metric
    (dalle_ablate/metrics.py) by guidance scale, with its 95% interval where it has one, then the
    model evaluators' headline metrics, a line per evaluator."""
    rows, lines = result.get("pareto") or [], []
    sampled = [m.key for m in headlines("samples")]
    for key in sampled:
        if rows and key in rows[0]:

            def interval(r: dict, key: str = key) -> str:
                return (
                    f" [{number(r[key + '_lo'], '.2f')}, {number(r[key + '_hi'], '.2f')}]" if key + "_lo" in r else ""
                )

            cells = [f"s{r['scale']:g} {number(r[key], '.3g')}{interval(r)}" for r in rows]
            lines.append(f"{key} (n={rows[0]['n']} per scale): " + ", ".join(cells))
    reranked = result.get("rerank") or []
    for key in [k for k in sampled if reranked and k in reranked[0]] or (["rerank/score"] if reranked else []):
        for scale in sorted({r["scale"] for r in reranked}):
            cells = [f"{r['best_of']}: {number(r[key], '.3g')}" for r in reranked if r["scale"] == scale]
            lines.append(f"{key} best of N at s{scale:g}: " + ", ".join(cells))
    model, by_evaluator = result.get("model") or {}, {}
    for m in headlines("model"):
        if m.logged() in model:
            by_evaluator.setdefault(m.key.split("/")[0], []).append(m)
    for name, found in by_evaluator.items():  # "caption sensitivity, nats per image: color 4.95, ..."
        lines.append(
            f"{name.replace('_', ' ')}, {found[0].unit}: "
            + ", ".join(f"{m.key.split('/', 1)[1]} {number(model[m.logged()], '.2f')}" for m in found)
        )
    return lines


def table_columns(rows: list[dict]) -> list[str]:
    """A table's columns: every key any row has, in first-seen order. A rate over no checks is left
    out of its row (shapes_parser._rates: e.g. a tier none of whose objects was found at one guidance
    scale), so the first row alone may lack a column a later one has; the table shows NaN there."""
    return list(dict.fromkeys(k for r in rows for k in r))


def pareto_png(rows: list[dict], x: str, y: str, title: str) -> np.ndarray:
    """One point per guidance scale, joined in order of scale and labelled with it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(rows, key=lambda r: r["scale"])
    fig, ax = plt.subplots(figsize=(4.5, 3.5), dpi=100)
    xs, ys = [r[x] for r in rows], [r[y] for r in rows]
    ax.plot(xs, ys, "-o", color="tab:blue")
    if f"{y}_lo" in rows[0]:  # the 95% interval of a rate (shapes/all: Wilson)
        err = [[b - r[f"{y}_lo"] for r, b in zip(rows, ys)], [r[f"{y}_hi"] - b for r, b in zip(rows, ys)]]
        ax.errorbar(xs, ys, yerr=err, fmt="none", ecolor="tab:blue", alpha=0.5, capsize=3)
    for r, a, b in zip(rows, xs, ys):
        ax.annotate(f"s={r['scale']:g}", (a, b), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    return figure_array(fig)


def rerank_png(rows: list[dict], metric: str, title: str) -> np.ndarray:
    """The metric against N (log scale), one line per guidance scale: DALL·E's figure 9."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.5, 3.5), dpi=100)
    for scale in sorted({r["scale"] for r in rows}):
        pts = sorted((r["best_of"], r[metric]) for r in rows if r["scale"] == scale)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "-o", label=f"s={scale:g}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("best of N (reranked)")
    ax.set_ylabel(metric)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return figure_array(fig)


def figure_array(fig) -> np.ndarray:
    """A matplotlib figure as an RGB array (the figure is closed)."""
    import matplotlib.pyplot as plt
    from PIL import Image

    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return np.asarray(Image.open(io.BytesIO(buf.getvalue())).convert("RGB"))


DURING = "during the sampling evaluation"  # what a Ctrl-C stopped, in the line the run ends with


class Evaluation:
    def __init__(self, cfg, dataset, model_cfg, graphdef, tracker, out_sharding=None):
        """`graphdef`: the float32 model graph (evaluation is in float32 whatever the training
        dtype); `cfg`: the RunConfig (its `eval` section)."""
        self.cfg, self.e = cfg, cfg.eval
        self.dataset, self.model_cfg, self.tracker = dataset, model_cfg, tracker
        self.graphdef = graphdef
        self.evaluators = {n: EVALUATORS.get(n) for n in self.e.metrics}
        self.skipped = [n for n, ev in self.evaluators.items() if not ev.available(dataset)]
        self.evaluators = {n: ev for n, ev in self.evaluators.items() if n not in self.skipped}
        self.can_draw = dataset.has_image_decoder()
        self.prompts, self.specs = dataset.eval_prompts(self.e.num_samples)
        self.cache: dict = {}  # what evaluators compute once per Evaluation (fixed prompts), e.g. a floor
        self.cache_dir = str(cfg.data.cache_dir)
        for name, ev in self.evaluators.items():
            if ev.setup is not None:
                self.cache[name] = ev.setup(self.e.settings(name), self.e)
        if self.e.rerank > 1 and self.can_draw:
            self.cache["rerank"] = SCORERS.get(self.e.rerank_scorer)(cfg)
        self.sampler = make_sampler(
            graphdef,
            model_cfg.image_len,
            temperature=self.e.temperature,
            top_k=self.e.top_k,
            top_p=self.e.top_p,
            guided=True,
            out_sharding=out_sharding,
        )
        self.blank = dataset.empty_caption()

        self._nll = jax.jit(
            lambda params, *batch: token_nll(nnx.merge(graphdef, params), *batch).sum(-1), out_shardings=out_sharding
        )
        self.params = None
        self.members: Optional[MemberEvaluations] = None  # set on a member's view: its draws are made for all members
        self.member = 0
        # The prompt grids, fixed for the Evaluation's life: (list, category, prompts).
        self.grid_prompts = [
            (name, category, [p.text for p in prompts])
            for name in self.e.grids
            for category, prompts in by_category(PROMPT_LISTS.get(name)(), self.e.grid_prompts).items()
        ]
        self.progress = tqdm(disable=True)  # one bar per run(), when cfg.trainer.progress (process 0)

    def _work(self) -> int:
        """Batches one run() samples, plus one per model evaluator: the progress bar's total."""

        def batches(n: int) -> int:
            return -(-n // self.e.batch_size)

        sampled = self.can_draw and self.prompts and any(ev.kind == "samples" for ev in self.evaluators.values())
        pareto = batches(len(self.prompts)) * len(self.e.guidance_scales) if sampled else 0
        grids = (
            sum(batches(len(texts) * self.e.grid_samples) for *_, texts in self.grid_prompts) if self.can_draw else 0
        )
        reranked = batches(len(self.prompts) * self.e.rerank) * len(self.e.rerank_scales) if self.reranks() else 0
        return (
            pareto
            + reranked
            + grids * len(self.e.grid_scales)
            + sum(ev.kind == "model" for ev in self.evaluators.values())
        )

    def reranks(self) -> bool:
        return self.e.rerank > 1 and self.can_draw and bool(self.prompts)

    # -- pieces ---------------------------------------------------------------------------------
    def reference_images(self) -> np.ndarray:
        """The real images of the eval prompts (computed once)."""
        if "real" not in self.cache:
            self.cache["real"] = self.dataset.eval_reference_images(len(self.prompts))
        return self.cache["real"]

    def _batches(self, n: int):
        b = self.e.batch_size
        for start in range(0, n, b):
            interrupts.check(DURING)
            idx = np.arange(start, min(start + b, n))
            yield (
                start // b,
                np.concatenate([idx, np.full(b - len(idx), idx[-1])]),
                len(idx),
            )  # fixed shape: one compile

    def per_image_nll(self, ids: np.ndarray, mask: np.ndarray, codes: np.ndarray) -> np.ndarray:
        out = np.zeros(len(codes), np.float64)
        for _, idx, k in self._batches(len(codes)):
            v = self._nll(self.params, jnp.asarray(ids[idx]), jnp.asarray(mask[idx]), jnp.asarray(codes[idx]))
            out[idx[:k]] = np.asarray(v)[:k]
        return out

    def sample(self, prompts: list[str], scale: float, repeats: int = 1) -> np.ndarray:
        """Codes [len(prompts) * repeats, image_len], prompt-major. Batch j always draws from
        fold_in(key(eval.seed), j): the same noise at every scale, step and checkpoint. A member's
        view (`MemberEvaluations`) reads its row of the draw made for all members at once."""
        if self.members is not None:
            return self.members.sample(prompts, scale, repeats)[self.member]
        return self.draw(self.sampler, self.params, prompts, scale, repeats)

    def draw(
        self, sampler, params, prompts: list[str], scale: float, repeats: int, lead: tuple[int, ...] = ()
    ) -> np.ndarray:
        """`sample` with this sampler and parameters; `lead`: the sampler's leading output axes
        (the members of a job), codes [*lead, len(prompts) * repeats, image_len]."""
        ids, mask = self.dataset.text.encode([p for p in prompts for _ in range(repeats)])
        out = np.zeros((*lead, len(ids), self.model_cfg.image_len), np.int32)
        key = jax.random.key(self.e.seed)
        for j, idx, k in self._batches(len(ids)):
            codes = sampler(
                params,
                jnp.asarray(ids[idx]),
                jnp.asarray(mask[idx]),
                jax.random.fold_in(key, j),
                jnp.asarray(self.blank[0]),
                jnp.asarray(self.blank[1]),
                jnp.asarray(scale, jnp.float32),
            )
            out[..., idx[:k], :] = np.asarray(codes)[..., :k, :]
            self.progress.update(1)
        return out

    # -- one evaluation -------------------------------------------------------------------------
    def run(self, params, step: int, run_name: str = "") -> dict:
        """Evaluate `params` at `step`; returns {"pareto": rows, "model": metrics}."""
        self.params = params
        # Sampling at every scale and the grids take about a minute on a CPU: show how far it is.
        show = self.cfg.trainer.progress and jax.process_index() == 0
        self.progress = tqdm(
            total=self._work(), desc=f"eval step {step}", unit="batch", disable=not show, dynamic_ncols=True
        )
        rows: list[dict] = []
        sample_evals = {n: ev for n, ev in self.evaluators.items() if ev.kind == "samples"}
        if sample_evals and self.can_draw and self.prompts:
            for scale in self.e.guidance_scales:
                images = self.dataset.decode_images(self.sample(self.prompts, scale))
                row = {"run": run_name, "step": int(step), "scale": float(scale), "n": len(images)}
                for name, ev in sample_evals.items():
                    row.update({f"{name}/{k}": v for k, v in ev.fn(images, self).items()})
                rows.append(row)
            self._log_pareto(rows, step, run_name)
        reranked: list[dict] = []
        if self.reranks():
            for scale in self.e.rerank_scales:
                reranked += rerank_rows(self, scale, run_name, step)
            self._log_rerank(reranked, step)
        model_metrics: dict[str, float] = {}
        for name, ev in self.evaluators.items():
            if ev.kind == "model":
                n = min(self.e.sensitivity_examples, len(self.dataset.specs["valid"]))
                specs = self.dataset.specs["valid"][:n]
                codes = self.dataset.codes["valid"][:n]
                model_metrics.update({f"eval/{name}/{k}": v for k, v in ev.fn(self, specs, codes, self.e.seed).items()})
                self.progress.update(1)
        if model_metrics:
            self.tracker.log(model_metrics, step)
        if self.can_draw:
            self._grids(step)
        self.progress.close()
        interrupts.check(DURING)  # an evaluation a Ctrl-C cut short is not complete: a resume runs it again
        return {"pareto": rows, "model": model_metrics, "rerank": reranked}

    def _log_pareto(self, rows: list[dict], step: int, run_name: str) -> None:
        columns = table_columns(rows)
        for r in rows:  # scalars too, one series per scale, for W&B's own charts and reports
            self.tracker.log(
                {
                    f"eval/pareto/s{r['scale']:g}/{k}": v
                    for k, v in r.items()
                    if k not in ("run", "step", "scale") and not isinstance(v, str)
                },
                step,
            )
        axes = pareto_axes(rows[0])
        self.tracker.log_table(
            "eval/pareto", columns, [[r.get(c, math.nan) for c in columns] for r in rows], step, line=axes
        )
        if axes is not None:
            title = f"step {step}, N={rows[0]['n']} per scale: {axes[1]} vs {axes[0]}"
            self.tracker.log_image("eval/pareto_plot", pareto_png(rows, *axes, title), step, caption=title)

    def _log_rerank(self, rows: list[dict], step: int) -> None:
        scorer = self.cache["rerank"]
        for r in rows:
            self.tracker.log(
                {
                    f"eval/rerank/s{r['scale']:g}/best_of{r['best_of']}/{k}": v
                    for k, v in r.items()
                    if k not in ("run", "step", "scale", "best_of") and not isinstance(v, str)
                },
                step,
            )
        columns = table_columns(rows)
        self.tracker.log_table("eval/rerank", columns, [[r.get(c, math.nan) for c in columns] for r in rows], step)
        metric = next((m.key for m in headlines("samples") if m.key in rows[0]), "rerank/score")
        title = f"step {step}: {metric}, best of N by {self.e.rerank_scorer} {scorer.hash}"
        self.tracker.log_image("eval/rerank_plot", rerank_png(rows, metric, title), step, caption=title)

    def _grids(self, step: int) -> None:
        table = []
        for list_name, category, texts in self.grid_prompts:
            for scale in self.e.grid_scales:
                images = self.dataset.decode_images(self.sample(texts, scale, self.e.grid_samples))
                grid = image_grid(images, texts, self.e.grid_samples)
                key = f"grids/{list_name}/{slug(category)}/s{scale:g}"
                self.tracker.log_image(key, grid, step, caption=f"{list_name} / {category} at scale {scale:g}")
                for i, t in enumerate(texts):
                    for k in range(self.e.grid_samples):
                        table.append([list_name, category, t, float(scale), k, images[i * self.e.grid_samples + k]])
        if table:
            self.tracker.log_table(
                "eval/grids", ["list", "category", "prompt", "scale", "sample", "image"], table, step
            )


class MemberEvaluations:
    """The sampling evaluation of the members of one job (train/loop.py train_members): a view of one
    Evaluation per member, each logging to its member's tracker and computing its own metrics,
    while every draw (each guidance scale, grid and rerank) is made once for all members by
    `batched` -- the sampler mapped over the members' stacked parameters with the key, prompts and
    scale shared, so that each member draws the noise its separate run would."""

    def __init__(self, evaluation: Evaluation, trackers: list, batched: Callable):
        self.base, self.batched = evaluation, batched
        self.views = []
        for i, tracker in enumerate(trackers):
            view = copy.copy(evaluation)  # shares the compiled sampler, prompts and evaluators' setup
            view.tracker, view.members, view.member = tracker, self, i
            self.views.append(view)
        self.params, self.drawn = None, {}

    def sample(self, prompts: list[str], scale: float, repeats: int) -> np.ndarray:
        """Codes [members, len(prompts) * repeats, image_len], drawn on the first member's request."""
        key = (tuple(prompts), float(scale), repeats)
        if key not in self.drawn:
            self.drawn[key] = self.base.draw(
                self.batched, self.params, prompts, scale, repeats, lead=(len(self.views),)
            )
        return self.drawn[key]

    def run(self, stacked_params, step: int, members: dict[int, tuple[Any, str]]) -> dict[int, dict]:
        """Evaluate the members named in `members` (index -> (its parameters, its run name)) at
        `step`; each member's result as `Evaluation.run` returns it."""
        self.params, self.drawn = stacked_params, {}
        try:
            return {i: self.views[i].run(params, step, name) for i, (params, name) in members.items()}
        finally:
            self.params, self.drawn = None, {}


def evaluation_or_none(cfg, dataset, model_cfg, graphdef, tracker, out_sharding=None) -> Optional[Evaluation]:
    """An Evaluation, or None when nothing is left to evaluate on this data."""
    ev = Evaluation(cfg, dataset, model_cfg, graphdef, tracker, out_sharding)
    if ev.skipped:
        print(f"eval: skipping {', '.join(ev.skipped)} (data={dataset.name} has no scene specs)")
    if not ev.evaluators and not (ev.can_draw and cfg.eval.grids):
        return None
    return ev
