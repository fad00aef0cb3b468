"""Command line: the `dalle-ablate` console script, and the error handling around `run.py`.

User mistakes (an unknown config option or field, a bad value, a bad data file) end in one line
on stderr naming what is wrong and what would be valid, and exit code 2; anything else is a bug
and keeps its full traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable, Optional

from dalle_ablate.parallel.devices import DEVICES
from dalle_ablate.validate import compose, format_error
from dalle_ablate.registry import ConfigError, RunFailed


HYDRA_JOB_ERROR = "Error executing job with overrides: "


class _JobErrorLine:
    """sys.stderr while a `@hydra.main` function runs: Hydra writes "Error executing job with
    overrides: [...]" just before it re-raises a job's exception; the line is held back, so that
    the error is one line on stderr (with a multirun's job overrides folded in)."""

    def __init__(self, stream):
        self.stream, self.overrides = stream, None

    def write(self, text: str) -> int:
        if text.startswith(HYDRA_JOB_ERROR):
            self.overrides = text[len(HYDRA_JOB_ERROR):].strip()
            return len(text)
        return self.stream.write(text)

    def __getattr__(self, name):
        return getattr(self.stream, name)


def _multirun() -> bool:
    """Whether the command line asked for a multirun (Hydra has forgotten by the time a job's error reaches us)."""
    return any(a in ("-m", "--multirun") or a.replace(" ", "") == "hydra.mode=MULTIRUN" for a in sys.argv[1:])


def run_hydra(main: Callable[[], object]) -> None:
    """Call a `@hydra.main` function: a user mistake is one line and exit code 2, a run that
    diverged or failed for a known reason one line and its code (docs/guides/troubleshooting.md)."""
    # Hydra would print multi-line messages and exit 1 itself; let the exception reach us.
    os.environ["HYDRA_FULL_ERROR"] = "1"
    from dalle_ablate.launch.jobs import WorkerLost

    stderr = sys.stderr = _JobErrorLine(sys.stderr)

    def fail(msg: str, code: int) -> None:
        if stderr.overrides and _multirun():  # which job of the multirun failed: Hydra prints its overrides' list
            import ast

            try:
                job = " ".join(ast.literal_eval(stderr.overrides))
            except (ValueError, SyntaxError, TypeError):
                job = stderr.overrides
            msg = f"{msg} (job: {job})"
        print(f"error: {msg}", file=stderr.stream)
        sys.exit(code)

    try:
        main()
    except RunFailed as ex:  # diverged, or failed for a known reason: the run store says so too
        fail(str(ex), ex.exit_code)
    except WorkerLost as ex:  # a cluster launcher's job killed, timed out or its node lost (a sweep goes on)
        fail(str(ex), RunFailed.FAILED)
    except KeyboardInterrupt as ex:  # Ctrl-C: a run in its steps saved a checkpoint and says how to resume
        fail(str(ex) or "interrupted", 130)
    except Exception as ex:  # noqa: BLE001 - re-raised unless it is a user mistake
        msg = format_error(ex) or (format_error(ex.__cause__) if ex.__cause__ else None)
        if msg is None:
            if stderr.overrides:  # a bug: Hydra's line above its traceback, as Hydra prints it
                stderr.stream.write(f"{HYDRA_JOB_ERROR}{stderr.overrides}{os.linesep}")
            raise
        fail(msg, 2)
    finally:
        sys.stderr = stderr.stream


VERBS: dict[str, tuple[Callable, Callable, dict]] = {}  # name -> (command, its arguments, add_parser's keywords)


def verb(name: str, arguments: Callable[[argparse.ArgumentParser], None], **parser_kwargs):
    """`cmd_*` as the verb `dalle-ablate <name>`: its arguments are added by `arguments(parser)`,
    the function just above it; `parser_kwargs` (help, description, epilog) go to add_parser."""

    def register(cmd):
        VERBS[name] = (cmd, arguments, parser_kwargs)
        return cmd

    return register


def cmd_encode_images(args) -> None:
    """A folder of images with captions -> dalle-mini's parquet, through a VQGAN."""
    from dalle_ablate.vqgan import load_vqgan
    from dalle_ablate.data.image_folder import encode_folder

    if not args.vqgan:
        raise ConfigError("--images needs --vqgan WEIGHTS.npz (convert a taming-transformers checkpoint with convert-vqgan)")
    vqgan = load_vqgan(args.vqgan, "--vqgan")
    path = encode_folder(args.images, vqgan, args.out, args.batch)
    n = vqgan.cfg.n_embed
    print(f"wrote {path}")
    print(f"train on it: python run.py data=parquet data.path={path} data.image_vocab={n} data.vqgan_path={args.vqgan}")


def _convert_vqgan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint")
    p.add_argument("out")
    p.add_argument("--config", help="its taming-transformers yaml (default: vqgan_imagenet_f16_16384's shape)")


@verb("convert-vqgan", _convert_vqgan_arguments,
      help="a taming-transformers VQGAN checkpoint (.ckpt, or .npz of its state dict) -> .npz")
def cmd_convert_vqgan(args) -> None:
    """A taming-transformers VQGAN checkpoint -> this project's .npz weights."""
    from dalle_ablate.vqgan import VQGANConfig, convert_state_dict, save_vqgan
    from dalle_ablate.vqgan.model import config_from_taming_yaml
    from dalle_ablate.weights import read_state_dict

    cfg = config_from_taming_yaml(args.config) if args.config else VQGANConfig()
    model = convert_state_dict(read_state_dict(args.checkpoint), cfg)
    save_vqgan(model, args.out)
    print(f"wrote {args.out} ({cfg.n_embed} codes, f{cfg.factor}, {cfg.resolution} px)")


def _convert_inception_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint")
    p.add_argument("out")


@verb("convert-inception", _convert_inception_arguments,
      help="FID Inception weights (torch-fidelity's weights-inception-2015-12-05-"
      "6726825d.pth, or an .npz of that state dict) -> .npz for eval.fid.weights")
def cmd_convert_inception(args) -> None:
    """torch-fidelity's / pytorch-fid's FID Inception weights -> this project's .npz."""
    from dalle_ablate.evaluate.inception import convert_state_dict, save_inception
    from dalle_ablate.weights import file_hash, read_state_dict

    save_inception(convert_state_dict(read_state_dict(args.checkpoint)), args.out)
    print(f"wrote {args.out} (FID Inception, pool3 2048-d; weights hash {file_hash(args.out)})")


def _convert_clip_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint")
    p.add_argument("out")
    p.add_argument("--bpe", required=True, help="bpe_simple_vocab_16e6.txt.gz (ships with the CLIP and open_clip packages)")
    p.add_argument("--act", choices=["quick_gelu", "gelu"], default="quick_gelu",
                   help="MLP activation: quick_gelu for OpenAI's weights (default), gelu for open_clip's own ViT-* models")
    p.add_argument("--head-width", type=int, default=64, help="attention head width (64 in every OpenAI model)")


@verb("convert-clip", _convert_clip_arguments,
      help="a CLIP ViT checkpoint (OpenAI .pt, open_clip .pt/.bin/.safetensors, or .npz of "
      "its state dict) and CLIP's BPE merges -> .npz for eval.clip.weights")
def cmd_convert_clip(args) -> None:
    """An OpenAI or open_clip CLIP ViT checkpoint + CLIP's BPE merges -> one .npz."""
    from dalle_ablate.evaluate.clip import config_from_state_dict, convert_state_dict, read_bpe, save_clip
    from dalle_ablate.weights import read_state_dict

    sd = read_state_dict(args.checkpoint)
    cfg = config_from_state_dict(sd, act=args.act, head_width=args.head_width)
    save_clip(convert_state_dict(sd, cfg), read_bpe(args.bpe), args.out)
    print(f"wrote {args.out} (CLIP ViT patch {cfg.patch_size}, {cfg.image_size} px, width {cfg.vision_width}x"
          f"{cfg.vision_layers}, text {cfg.text_width}x{cfg.text_layers}, embed {cfg.embed_dim}, {cfg.act})")


def _fid_reference_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--weights", required=True, help="FID Inception weights (.npz from convert-inception)")
    p.add_argument("--out", required=True, help="output .npz")
    p.add_argument("--images", help="a folder of images (any sizes; searched recursively)")
    p.add_argument("--num", type=int, help="at most this many images (default: all of the folder; 10000 of a data split)")
    p.add_argument("overrides", nargs="*", help="data config overrides, e.g. data=parquet data.path=... data.vqgan_path=...")


@verb("fid-reference", _fid_reference_arguments, help="FID reference statistics (.npz for eval.reference) of a folder of images "
      "(--images) or of a data config's valid split")
def cmd_fid_reference(args) -> None:
    """FID reference statistics of a folder of images, or of a run's data (its valid split)."""
    from dalle_ablate.evaluate.fid import read_image_folder, reference_from_images
    from dalle_ablate.evaluate.inception import InceptionFeatures

    net = InceptionFeatures(args.weights, "--weights")
    if args.images:
        if args.overrides:
            raise ConfigError(f"--images and config overrides ({' '.join(args.overrides)}) exclude each other")
        ref = reference_from_images(net, read_image_folder(args.images, args.num), f"folder {args.images}")
    else:
        from dalle_ablate.data import build_dataset
        from dalle_ablate.validate import to_run_config

        cfg = to_run_config(compose(args.overrides))
        ds = build_dataset(cfg.data, cfg.model)
        images = ds.reference_images(args.num or 10_000)
        if images is None:
            raise ConfigError(f"data={cfg.data.name} has no image decoder (set data.codebook_path or data.vqgan_path), "
                              "so it has no real images; use --images")
        ref = reference_from_images(net, images, f"data={cfg.data.name} valid split")
    ref.save(args.out)
    print(f"wrote {args.out}: {ref.n} images ({ref.source}), Inception weights {ref.weights}, {ref.resize}")


def _encode_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--images", help="a folder of images, each with its caption in a .txt of the same name")
    p.add_argument("--vqgan", help="VQGAN weights (.npz) for --images")
    p.add_argument("--batch", type=int, default=16, help="images encoded at once (--images)")
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. data.num_train=1000 data.patch_size=4")


@verb("encode", _encode_arguments, help="write parquet for data=parquet: the built-in shapes data, or a folder of images "
      "with captions through a VQGAN (--images, --vqgan)")
def cmd_encode(args) -> None:
    """Write the shapes data in dalle-mini's parquet format, with the codebook and tokenizer."""
    if args.images:
        return cmd_encode_images(args)
    from dalle_ablate.data.parquet import write_parquet
    from dalle_ablate.data.shapes import SPLITS, ShapesDataset
    from dalle_ablate.validate import to_run_config

    cfg = to_run_config(compose(["data=shapes", *args.overrides]))
    if cfg.data.tokenizer != "kmeans":  # data=parquet decodes with a patch codebook (or a VQGAN of its own)
        raise ConfigError(f"dalle-ablate encode writes the k-means codebook.npz data=parquet decodes with; "
                          f"data.tokenizer={cfg.data.tokenizer} has none (train on data=shapes data.tokenizer={cfg.data.tokenizer})")
    ds = ShapesDataset(cfg.data, cfg.model.text_len)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for split in SPLITS:
        write_parquet(out / f"{split}.parquet", ds.captions[split], ds.codes[split])
    ds.tokenizer.save(out / "codebook.npz")
    ds.text.tok.save(str(out / "tokenizer.json"))
    n = {s: len(ds.codes[s]) for s in SPLITS}
    print(f"wrote {out}/{{train,valid,test}}.parquet ({n['train']}/{n['valid']}/{n['test']} rows, "
          f"{ds.image_len} codes of {ds.image_vocab}), codebook.npz, tokenizer.json")
    print(
        f"train on it: python run.py data=parquet data.path={out}/train.parquet data.valid_path={out}/valid.parquet "
        f"data.image_vocab={ds.image_vocab} data.codebook_path={out}/codebook.npz data.tokenizer_path={out}/tokenizer.json"
    )


def abstract_setup(overrides: list[str]):
    """(run config, model config with the data's sizes, params -> its train state) without reading
    any data."""
    from dalle_ablate.train.assembly import abstract_run
    from dalle_ablate.validate import to_run_config

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
    p.add_argument("overrides", nargs="*", help="Hydra overrides, as for run.py (see below)")
    p.add_argument("--device", help=f"an accelerator to check against: {', '.join(DEVICES)}")
    p.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation for the step time (default 0.4)")


@verb("plan", _plan_arguments, help="per-device memory and FLOPs on a mesh of any size (no allocation, no devices)",
      description="Per-device memory (parameters, gradients, optimizer state, activations by remat policy), "
      "communication per mesh axis, checkpoint size and FLOPs of a run, from abstract shapes: any size, "
      "any mesh, on this machine. With --device: whether it fits, and its step time at --mfu.",
      epilog="overrides it reads: size=, model=, model.dtype=, model.glu=, model.* (the shapes), optim= (its state), "
      "mesh.data=, mesh.fsdp=, mesh.model= (-1 counts as 1), trainer.batch_size=, trainer.grad_accum=, and data= "
      "(image and vocabulary sizes, from the config alone). Example: dalle-ablate plan size=mega "
      "model=normformer optim=adam mesh.data=32 mesh.model=8 trainer.batch_size=4224 --device tpu-v3")
def cmd_plan(args) -> None:
    """Per-device memory and FLOPs of a config on its mesh, from abstract shapes."""
    from dalle_ablate.parallel.plan import plan

    print(plan(*abstract_setup(args.overrides), device=args.device, mfu=args.mfu))


def _eval_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="a run dir (its latest checkpoint), its run/ or run/checkpoints/, or one step's folder")
    p.add_argument("overrides", nargs="*", help="e.g. eval=drawbench eval.guidance_scales=[1,3,5] eval.num_samples=128")


@verb("eval", _eval_arguments, help="evaluate a checkpoint: metrics per guidance scale, caption sensitivity, prompt grids")
def cmd_eval(args) -> None:
    """Guidance-scale Pareto, caption sensitivity and prompt grids of a saved checkpoint."""
    from dalle_ablate.train.eval_checkpoint import evaluate_checkpoint

    evaluate_checkpoint(args.path, args.overrides)


def _train_scorer_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("overrides", nargs="*", help="e.g. eval.scorer.seed=1 eval.scorer.steps=3000 data.cache_dir=...")


@verb("train-scorer", _train_scorer_arguments, help="train (or load from data.cache_dir) the contrastive shapes scorer that "
      "eval.rerank uses; prints its held-out retrieval accuracy")
def cmd_train_scorer(args) -> None:
    """Train (or load from the cache) the contrastive shapes scorer of `eval.scorer` and print its
    held-out retrieval accuracy."""
    import time

    from dalle_ablate.evaluate.contrastive import ContrastiveScorer
    from dalle_ablate.validate import to_run_config

    cfg = to_run_config(compose(args.overrides))
    cfg.eval.scorer.check_all(cfg, "eval.scorer")
    t = time.perf_counter()
    scorer = ContrastiveScorer(cfg.data.cache_dir, cfg.eval.scorer)
    r = scorer.retrieval
    print(f"{'trained' if scorer.trained else 'loaded'} scorer {scorer.hash} in {time.perf_counter() - t:.1f} s: {scorer.path}")
    print(f"held-out retrieval, top-1 among {r['group']} ({r['pairs']} pairs, seed {cfg.eval.scorer.seed + 2}; chance "
          f"{1 / r['group']:.1%}): caption -> image {r['text_to_image']:.1%}, image -> caption {r['image_to_text']:.1%}")
    print(f"binding: the true caption outscores it with two colours swapped in {r['binding']:.1%} of the held-out scenes "
          f"with two colours (chance 50%)")


def _train_tokenizer_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("overrides", nargs="*", help="e.g. data.tokenizer=dvae data.dvae.steps=3000 data.codebook_size=512")
    p.add_argument("--out", default="outputs/tokenizers", help="folder of the run stores (default: outputs/tokenizers)")


@verb("train-tokenizer", _train_tokenizer_arguments, help="fit (or load from data.cache_dir) the built-in data's image tokenizer "
      "(data.tokenizer=kmeans|dvae|vqgan) with its own run store and tracker run; "
      "prints the shapes parser's score on its held-out reconstructions")
def cmd_train_tokenizer(args) -> None:
    """Fit (or load from data.cache_dir) the built-in data's image tokenizer, with its own run
    store and tracker run, and print its held-out reconstruction scores."""
    from dalle_ablate.data.shapes import scenes_key
    from dalle_ablate.data.image_tokenizer import IMAGE_TOKENIZERS
    from dalle_ablate.train.tokenizer import closing_lines, train_tokenizer
    from dalle_ablate.validate import to_run_config

    cfg = to_run_config(compose(args.overrides))
    key = IMAGE_TOKENIZERS.get(cfg.data.tokenizer).key(cfg.data, scenes_key(cfg.data))
    result = train_tokenizer(cfg, Path(args.out) / f"{cfg.data.tokenizer}-{key}", overrides=args.overrides)
    print(closing_lines(cfg, result))


def _report_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", help="a multirun or sweep folder, a glob of run stores ('outputs/*/*/run'), or "
                                  "wandb:ENTITY/PROJECT/GROUP (needs a W&B login and network)")
    p.add_argument("--out", default="reports", help="folder the report's folder goes in (default: reports)")
    p.add_argument("--name", help="the report's folder name (default: from the source path)")
    p.add_argument("--baseline", help="the variant the others are compared with, or a unique part of its label, "
                                      "e.g. model=preln (default: the first value listed; a sweep: the best completed trial)")
    p.add_argument("--wandb-entity", help="with --wandb-project: also save the report to W&B (needs a login and network)")
    p.add_argument("--wandb-project")


@verb("report", _report_arguments, help="an ablation report of a multirun/sweep folder or a glob of run stores: "
      "reports/<name>/index.html, report.md, runs.csv, wandb_report.json")
def cmd_report(args) -> None:
    """An ablation report of a multirun or sweep folder (or a glob of run stores)."""
    import time

    from dalle_ablate.report import build_report

    t = time.perf_counter()
    skipped: list[str] = []
    folder = build_report(args.source, args.out, args.name, args.baseline, args.wandb_entity or "", args.wandb_project or "",
                          skipped)
    print(f"wrote {folder}/index.html, report.md, runs.csv, wandb_report.json ({time.perf_counter() - t:.1f} s)")
    for why in skipped:  # each also in the report's first section
        print(f"warning: left out, unreadable: {why}", file=sys.stderr)


def _study_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("study", help="a study of dalle_ablate/report/studies/ (mega-variants), or a study file of your own (.yaml)")
    p.add_argument("--out", default="studies", help="folder of the study's runs (default: studies/<name>)")
    p.add_argument("--report-out", default="reports", help="folder of the report (default: reports/<name>)")
    p.add_argument("--page-out", default="docs/results", help="folder of the results page <name>.md and its "
                                                               "figures/ (default: docs/results)")
    p.add_argument("--no-run", action="store_true", help="only the report and the page, from the runs there are")
    p.add_argument("--seeds", help="top a study that has run up to N seeds per arm (its finished runs are not rerun), or "
                                   "'auto': to the seeds its page's rule asks for, from the pooled noise and the margins "
                                   "only (docs/statistics.md)")
    p.add_argument("--no-stress", action="store_true", help="skip the study's stress runs (its file's `stress:` section: "
                                                            "the stability claims' arms across learning rates)")
    p.add_argument("overrides", nargs="*", help="overrides for every run, e.g. trainer.steps=500 '+arm=baseline,bias' "
                                                "seed=0,1 (a sweep of the preset's own keys replaces it)")


@verb("study", _study_arguments, help="run a published study's arms with seeds (finished runs are skipped), then its "
      "report and a results page with a verdict per finding")
def cmd_study(args) -> None:
    """Run a study's arms and seeds (its multirun preset; runs that finished are left as they are,
    a stopped one continues from its checkpoint), then its report and its results page."""
    import json
    import time

    from dalle_ablate.report import build_report
    from dalle_ablate.report.findings import load_study, study_path
    from dalle_ablate.report.page import provenance as page_provenance, write_page
    from dalle_ablate.report.study_runs import call_child, dies_with_this_process, run_stress
    from dalle_ablate.report.load import find_stores, load_runs

    study_file = Path(args.study) if args.study.endswith((".yaml", ".yml")) else study_path(args.study)
    study = load_study(study_file)
    folder = Path(args.out) / study.name
    overrides = list(args.overrides)
    if args.seeds is not None:  # a top-up: more seeds for every arm, the finished runs left as they are
        from dalle_ablate.fileio import atomic_write
        from dalle_ablate.report.findings import TOPUPS, plan_topup

        if args.no_run:
            raise ConfigError("--seeds runs the added seeds; it cannot go with --no-run")
        seed_override, topup = plan_topup(study, folder, args.seeds, overrides)
        overrides.append(seed_override)
        print(f"study {study.name}: topping up from {topup['from']} to {topup['to']} seeds per arm ({seed_override}; the "
              f"rule asks for {topup['rule']})")
    command = [sys.executable, "-m", "dalle_ablate.job", "-m", f"experiment={study.experiment}", f"hydra.sweep.dir={folder}",
               *overrides]
    t = time.perf_counter()
    # The seeds of an arm compile the same programs: JAX's persistent compilation cache
    # (jax_compilation_cache_dir) lets every run after the first of its arm load them from disk.
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": os.environ.get("JAX_COMPILATION_CACHE_DIR", str(folder / "jax_cache"))}
    preexec = dies_with_this_process()
    code = 0 if args.no_run else call_child(command, env, preexec)
    if args.seeds is not None and code == 0:  # logged once its runs are in: a failed top-up is no top-up
        log = folder / TOPUPS
        atomic_write(log, json.dumps([*(json.loads(log.read_text()) if log.exists() else []),
                                      {**topup, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}], indent=1))
    stress = None if args.no_run or args.no_stress else run_stress(study_file, study.experiment, folder, args.overrides, env,
                                                                   preexec)
    elapsed = time.perf_counter() - t
    try:
        find_stores(str(folder))
    except ConfigError:
        raise RunFailed(f"study {study.name}: no runs under {folder} (the multirun exited with {code})", code or 4) from None
    runs = load_runs(str(folder))  # a torn or unreadable file of a run store: named in one line
    for r in runs:  # its overrides say which arm a run is (report/findings.py arm_of)
        if not (r.root / "meta.json").is_file():
            raise ConfigError(f"{r.root / 'meta.json'}: no such file, so the study cannot tell which arm the run is; delete "
                              f"{r.root.parent} and run the study again to train it anew")
    provenance = page_provenance(args.study, args.seeds, args.overrides, command, runs, elapsed, not args.no_run,
                                 stress.line if stress is not None else None)
    report = build_report(str(folder), args.report_out, study.name, study.baseline)
    page = write_page(study, str(folder), Path(args.page_out), provenance, study_file=study_file)
    print(f"wrote {report}/index.html and {page}")
    if code:
        raise RunFailed(f"study {study.name}: the multirun exited with {code}; the page shows the runs that finished", code)
    if stress is not None and stress.failed:
        raise RunFailed(f"study {study.name}: stress runs failed (not diverged): {', '.join(stress.failed)}")


def build_parser() -> argparse.ArgumentParser:
    """The `dalle-ablate` parser and its verbs, in the order they are defined here (docs/reference/cli.md is
    generated from it)."""
    parser = argparse.ArgumentParser(prog="dalle-ablate", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    for name, (cmd, arguments, kwargs) in VERBS.items():
        arguments(sub.add_parser(name, **kwargs))
        sub.choices[name].set_defaults(func=cmd)
    return parser


def main(argv: Optional[list[str]] = None) -> None:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.verb == "study":  # its overrides may follow its options: `study mega-variants --out x trainer.steps=500`
        args.overrides += [e for e in extra if not e.startswith("-")]
        extra = [e for e in extra if e.startswith("-")]
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        args.func(args)
    except RunFailed as ex:  # e.g. a study whose multirun failed: its page is written, the exit code says so
        print(f"error: {ex}", file=sys.stderr)
        sys.exit(ex.exit_code)
    except KeyboardInterrupt:  # Ctrl-C: what finished is kept (a study's runs, a report's files), no traceback
        again = " (run the same command again: finished runs are skipped, a stopped one continues)" if args.verb == "study" else ""
        print(f"error: dalle-ablate {args.verb} interrupted{again}", file=sys.stderr)
        sys.exit(130)
    except Exception as ex:  # noqa: BLE001 - re-raised unless it is a user mistake
        msg = format_error(ex)
        if msg is None:
            raise
        print(f"error: {msg}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
