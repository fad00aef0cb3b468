"""Verbs that write files other verbs and runs read: converted weights (VQGAN, FID Inception,
CLIP), FID reference statistics, and parquet data."""

from __future__ import annotations

import argparse
from pathlib import Path

from dalle_ablate.cli.verbs import verb
from dalle_ablate.registry import ConfigError


def cmd_encode_images(args) -> None:
    """A folder of images with captions -> dalle-mini's parquet, through a VQGAN."""
    from dalle_ablate.vqgan import load_vqgan
    from dalle_ablate.data.image_folder import encode_folder

    if not args.vqgan:
        raise ConfigError(
            "--images needs --vqgan WEIGHTS.npz (convert a taming-transformers checkpoint with convert-vqgan)"
        )
    vqgan = load_vqgan(args.vqgan, "--vqgan")
    path = encode_folder(args.images, vqgan, args.out, args.batch)
    n = vqgan.cfg.n_embed
    print(f"wrote {path}")
    print(f"train on it: python run.py data=parquet data.path={path} data.image_vocab={n} data.vqgan_path={args.vqgan}")


def _convert_vqgan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint")
    p.add_argument("out")
    p.add_argument("--config", help="its taming-transformers yaml (default: vqgan_imagenet_f16_16384's shape)")


@verb(
    "convert-vqgan",
    _convert_vqgan_arguments,
    help="a taming-transformers VQGAN checkpoint (.ckpt, or .npz of its state dict) -> .npz",
)
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


@verb(
    "convert-inception",
    _convert_inception_arguments,
    help="FID Inception weights (torch-fidelity's weights-inception-2015-12-05-"
    "6726825d.pth, or an .npz of that state dict) -> .npz for eval.fid.weights",
)
def cmd_convert_inception(args) -> None:
    """torch-fidelity's / pytorch-fid's FID Inception weights -> this project's .npz."""
    from dalle_ablate.evaluate.inception import convert_state_dict, save_inception
    from dalle_ablate.weights import file_hash, read_state_dict

    save_inception(convert_state_dict(read_state_dict(args.checkpoint)), args.out)
    print(f"wrote {args.out} (FID Inception, pool3 2048-d; weights hash {file_hash(args.out)})")


def _convert_clip_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint")
    p.add_argument("out")
    p.add_argument(
        "--bpe", required=True, help="bpe_simple_vocab_16e6.txt.gz (ships with the CLIP and open_clip packages)"
    )
    p.add_argument(
        "--act",
        choices=["quick_gelu", "gelu"],
        default="quick_gelu",
        help="MLP activation: quick_gelu for OpenAI's weights (default), gelu for open_clip's own ViT-* models",
    )
    p.add_argument("--head-width", type=int, default=64, help="attention head width (64 in every OpenAI model)")


@verb(
    "convert-clip",
    _convert_clip_arguments,
    help="a CLIP ViT checkpoint (OpenAI .pt, open_clip .pt/.bin/.safetensors, or .npz of "
    "its state dict) and CLIP's BPE merges -> .npz for eval.clip.weights",
)
def cmd_convert_clip(args) -> None:
    """An OpenAI or open_clip CLIP ViT checkpoint + CLIP's BPE merges -> one .npz."""
    from dalle_ablate.evaluate.clip import config_from_state_dict, convert_state_dict, read_bpe, save_clip
    from dalle_ablate.weights import read_state_dict

    sd = read_state_dict(args.checkpoint)
    cfg = config_from_state_dict(sd, act=args.act, head_width=args.head_width)
    save_clip(convert_state_dict(sd, cfg), read_bpe(args.bpe), args.out)
    print(
        f"wrote {args.out} (CLIP ViT patch {cfg.patch_size}, {cfg.image_size} px, width {cfg.vision_width}x"
        f"{cfg.vision_layers}, text {cfg.text_width}x{cfg.text_layers}, embed {cfg.embed_dim}, {cfg.act})"
    )


def _fid_reference_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--weights", required=True, help="FID Inception weights (.npz from convert-inception)")
    p.add_argument("--out", required=True, help="output .npz")
    p.add_argument("--images", help="a folder of images (any sizes; searched recursively)")
    p.add_argument(
        "--num", type=int, help="at most this many images (default: all of the folder; 10000 of a data split)"
    )
    p.add_argument(
        "overrides", nargs="*", help="data config overrides, e.g. data=parquet data.path=... data.vqgan_path=..."
    )


@verb(
    "fid-reference",
    _fid_reference_arguments,
    help="FID reference statistics (.npz for eval.reference) of a folder of images "
    "(--images) or of a data config's valid split",
)
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
        from dalle_ablate.validate import compose, to_run_config

        cfg = to_run_config(compose(args.overrides))
        ds = build_dataset(cfg.data, cfg.model)
        images = ds.reference_images(args.num or 10_000)
        if images is None:
            raise ConfigError(
                f"data={cfg.data.name} has no image decoder (set data.codebook_path or data.vqgan_path), "
                "so it has no real images; use --images"
            )
        ref = reference_from_images(net, images, f"data={cfg.data.name} valid split")
    ref.save(args.out)
    print(f"wrote {args.out}: {ref.n} images ({ref.source}), Inception weights {ref.weights}, {ref.resize}")


def _encode_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--images", help="a folder of images, each with its caption in a .txt of the same name")
    p.add_argument("--vqgan", help="VQGAN weights (.npz) for --images")
    p.add_argument("--batch", type=int, default=16, help="images encoded at once (--images)")
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. data.num_train=1000 data.patch_size=4")


@verb(
    "encode",
    _encode_arguments,
    help="write parquet for data=parquet: the built-in shapes data, or a folder of images "
    "with captions through a VQGAN (--images, --vqgan)",
)
def cmd_encode(args) -> None:
    """Write the shapes data in dalle-mini's parquet format, with the codebook and tokenizer."""
    if args.images:
        return cmd_encode_images(args)
    from dalle_ablate.data.parquet import write_parquet
    from dalle_ablate.data.shapes import SPLITS, ShapesDataset
    from dalle_ablate.validate import compose, to_run_config

    cfg = to_run_config(compose(["data=shapes", *args.overrides]))
    if cfg.data.tokenizer != "kmeans":  # data=parquet decodes with a patch codebook (or a VQGAN of its own)
        raise ConfigError(
            f"dalle-ablate encode writes the k-means codebook.npz data=parquet decodes with; "
            f"data.tokenizer={cfg.data.tokenizer} has none (train on data=shapes data.tokenizer={cfg.data.tokenizer})"
        )
    ds = ShapesDataset(cfg.data, cfg.model.text_len)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for split in SPLITS:
        write_parquet(out / f"{split}.parquet", ds.captions[split], ds.codes[split])
    ds.tokenizer.save(out / "codebook.npz")
    ds.text.tok.save(str(out / "tokenizer.json"))
    n = {s: len(ds.codes[s]) for s in SPLITS}
    print(
        f"wrote {out}/{{train,valid,test}}.parquet ({n['train']}/{n['valid']}/{n['test']} rows, "
        f"{ds.image_len} codes of {ds.image_vocab}), codebook.npz, tokenizer.json"
    )
    print(
        f"train on it: python run.py data=parquet data.path={out}/train.parquet data.valid_path={out}/valid.parquet "
        f"data.image_vocab={ds.image_vocab} data.codebook_path={out}/codebook.npz data.tokenizer_path={out}/tokenizer.json"
    )
