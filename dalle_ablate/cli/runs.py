"""Verbs about a run's config and its checkpoints: describe and plan (from abstract shapes), eval
(a saved checkpoint), and the fitted helpers a run uses (the shapes scorer, the image tokenizer)."""

from __future__ import annotations

import argparse
from pathlib import Path

from dalle_ablate.cli.verbs import verb


def abstract_setup(overrides: list[str]):
    """(run config, model config with the data's sizes, params -> its train state) without reading
    any data."""
    from dalle_ablate.train.assembly import abstract_run
    from dalle_ablate.validate import compose, to_run_config

    cfg = to_run_config(compose(overrides))
    return (cfg, *abstract_run(cfg))


def _describe_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. model=normformer size=mega")


@verb("describe", _describe_arguments, help="parameters per module, FLOPs per image token, memory (no allocation)")
def cmd_describe(args) -> None:
    """Parameters per module, FLOPs per image token and memory, from abstract shapes."""
    from dalle_ablate.model.describe import describe

    cfg, model_cfg, new_state = abstract_setup(args.overrides)
    print(describe(model_cfg, new_state))
    print(f"(optimizer: {cfg.optim.name})")


def _plan_arguments(p: argparse.ArgumentParser) -> None:
    from dalle_ablate.parallel.devices import DEVICES  # imports JAX (the parallel package): only for plan

    p.add_argument("overrides", nargs="*", help="Hydra overrides, as for run.py (see below)")
    p.add_argument("--device", help=f"an accelerator to check against: {', '.join(DEVICES)}")
    p.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation for the step time (default 0.4)")


@verb(
    "plan",
    _plan_arguments,
    help="per-device memory and FLOPs on a mesh of any size (no allocation, no devices)",
    description="Per-device memory (parameters, gradients, optimizer state, activations by remat policy), "
    "communication per mesh axis, checkpoint size and FLOPs of a run, from abstract shapes: any size, "
    "any mesh, on this machine. With --device: whether it fits, and its step time at --mfu.",
    epilog="overrides it reads: size=, model=, model.dtype=, model.glu=, model.* (the shapes), optim= (its state), "
    "mesh.data=, mesh.fsdp=, mesh.model= (-1 counts as 1), trainer.batch_size=, trainer.grad_accum=, and data= "
    "(image and vocabulary sizes, from the config alone). Example: dalle-ablate plan size=mega "
    "model=normformer optim=adam mesh.data=32 mesh.model=8 trainer.batch_size=4224 --device tpu-v3",
)
def cmd_plan(args) -> None:
    """Per-device memory and FLOPs of a config on its mesh, from abstract shapes."""
    from dalle_ablate.parallel.plan import plan

    print(plan(*abstract_setup(args.overrides), device=args.device, mfu=args.mfu))


def _eval_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "path",
        help="a run dir (its latest checkpoint), its run/ or run/checkpoints/, or one step's folder; "
        "local or in a bucket (gs://bucket/runs/x)",
    )
    p.add_argument("overrides", nargs="*", help="e.g. eval=drawbench eval.guidance_scales=[1,3,5] eval.num_samples=128")


@verb(
    "eval", _eval_arguments, help="evaluate a checkpoint: metrics per guidance scale, caption sensitivity, prompt grids"
)
def cmd_eval(args) -> None:
    """Guidance-scale Pareto, caption sensitivity and prompt grids of a saved checkpoint."""
    from dalle_ablate import interrupts
    from dalle_ablate.train.eval_checkpoint import evaluate_checkpoint

    with interrupts.taken_at_checks():  # between the evaluation's batches, never inside one
        evaluate_checkpoint(args.path, args.overrides)


def _train_scorer_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("overrides", nargs="*", help="e.g. eval.scorer.seed=1 eval.scorer.steps=3000 data.cache_dir=...")


@verb(
    "train-scorer",
    _train_scorer_arguments,
    help="train (or load from data.cache_dir) the contrastive shapes scorer that "
    "eval.rerank uses; prints its held-out retrieval accuracy",
)
def cmd_train_scorer(args) -> None:
    """Train (or load from the cache) the contrastive shapes scorer of `eval.scorer` and print its
    held-out retrieval accuracy."""
    import time

    from dalle_ablate.evaluate.contrastive import ContrastiveScorer
    from dalle_ablate.validate import compose, to_run_config

    cfg = to_run_config(compose(args.overrides))
    cfg.eval.scorer.check_all(cfg, "eval.scorer")
    t = time.perf_counter()
    scorer = ContrastiveScorer(cfg.data.cache_dir, cfg.eval.scorer)
    r = scorer.retrieval
    print(
        f"{'trained' if scorer.trained else 'loaded'} scorer {scorer.hash} in {time.perf_counter() - t:.1f} s: {scorer.path}"
    )
    print(
        f"held-out retrieval, top-1 among {r['group']} ({r['pairs']} pairs, seed {cfg.eval.scorer.seed + 2}; chance "
        f"{1 / r['group']:.1%}): caption -> image {r['text_to_image']:.1%}, image -> caption {r['image_to_text']:.1%}"
    )
    print(
        f"binding: the true caption outscores it with two colours swapped in {r['binding']:.1%} of the held-out scenes "
        f"with two colours (chance 50%)"
    )


def _train_tokenizer_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("overrides", nargs="*", help="e.g. data.tokenizer=dvae data.dvae.steps=3000 data.codebook_size=512")
    p.add_argument("--out", default="outputs/tokenizers", help="folder of the run stores (default: outputs/tokenizers)")


@verb(
    "train-tokenizer",
    _train_tokenizer_arguments,
    help="fit (or load from data.cache_dir) the built-in data's image tokenizer "
    "(data.tokenizer=kmeans|dvae|vqgan) with its own run store and tracker run; "
    "prints the shapes parser's score on its held-out reconstructions",
)
def cmd_train_tokenizer(args) -> None:
    """Fit (or load from data.cache_dir) the built-in data's image tokenizer, with its own run
    store and tracker run, and print its held-out reconstruction scores."""
    from dalle_ablate.data.shapes import scenes_key
    from dalle_ablate.data.image_tokenizer import IMAGE_TOKENIZERS
    from dalle_ablate.train.tokenizer import closing_lines, train_tokenizer
    from dalle_ablate.validate import compose, to_run_config

    from dalle_ablate import interrupts

    cfg = to_run_config(compose(args.overrides))
    key = IMAGE_TOKENIZERS.get(cfg.data.tokenizer).key(cfg.data, scenes_key(cfg.data))
    with interrupts.taken_at_checks():  # between the fit's iterations and the renders, never inside one
        result = train_tokenizer(cfg, Path(args.out) / f"{cfg.data.tokenizer}-{key}", overrides=args.overrides)
    print(closing_lines(cfg, result))
