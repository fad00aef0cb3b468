"""`dalle-ablate encode --images FOLDER --vqgan WEIGHTS --out DIR`: a folder of images with their
captions -> dalle-mini's parquet format (a caption column and a list of VQGAN codes per row),
which `data=parquet` trains on. Each image `x.jpg` / `x.png` / `x.webp` has its caption in `x.txt`
(the layout img2dataset writes). Images are resized so the shorter side is the VQGAN's
resolution (bicubic) and centre-cropped, as dalle-mini's encoding notebook did."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
from flax import nnx
from PIL import Image
from tqdm.auto import tqdm

from dalle_ablate.registry import ConfigError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp")


def image_caption_pairs(folder: str | Path) -> list[tuple[Path, str]]:
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise ConfigError(f"--images {folder}: not a folder")
    pairs, missing = [], []
    for img in sorted(p for p in root.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES):
        txt = img.with_suffix(".txt")
        if txt.exists():
            pairs.append((img, txt.read_text(encoding="utf-8").strip()))
        else:
            missing.append(img.name)
    if missing:
        raise ConfigError(f"--images {folder}: {len(missing)} images have no caption file, e.g. {missing[0]} needs "
                          f"{Path(missing[0]).with_suffix('.txt')}")
    if not pairs:
        raise ConfigError(f"--images {folder}: no images ({', '.join(IMAGE_SUFFIXES)}) with captions found")
    return pairs


def load_square(path: Path, size: int) -> np.ndarray:
    img = Image.open(path).convert("RGB")
    scale = size / min(img.size)
    w, h = max(size, round(img.width * scale)), max(size, round(img.height * scale))
    img = img.resize((w, h), Image.Resampling.BICUBIC)
    left, top = (w - size) // 2, (h - size) // 2
    return np.asarray(img.crop((left, top, left + size, top + size)), np.uint8)


_COMPILED: dict = {}  # (id(model), method) -> (model, jitted fn, state): one compile per model and method


def _jitted(model, method: str):
    key = (id(model), method)
    if key not in _COMPILED:
        graphdef, state = nnx.split(model)
        _COMPILED[key] = (model, jax.jit(lambda s, x: getattr(nnx.merge(graphdef, s), method)(x)), state)
    _, fn, state = _COMPILED[key]
    return fn, state


def encode_folder(folder: str | Path, vqgan, out: str | Path, batch: int = 16, progress: bool = True) -> Path:
    """Encode every image of `folder`; write `out/data.parquet`. Returns its path."""
    from dalle_ablate.data.parquet import write_parquet

    pairs = image_caption_pairs(folder)
    size = vqgan.cfg.resolution
    fn, state = _jitted(vqgan, "encode")
    codes = []
    for start in tqdm(range(0, len(pairs), batch), total=-(-len(pairs) // batch), unit="batch", disable=not progress,
                      desc="encoding"):
        chunk = pairs[start : start + batch]
        images = np.stack([load_square(p, size) for p, _ in chunk])
        pad = np.concatenate([images, np.repeat(images[-1:], batch - len(images), 0)])  # one compiled shape
        codes.append(np.asarray(fn(state, pad))[: len(images)])
    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "data.parquet"
    write_parquet(path, [c for _, c in pairs], np.concatenate(codes))
    return path


def decode_codes(vqgan, codes: np.ndarray, batch: int = 16) -> np.ndarray:
    fn, state = _jitted(vqgan, "decode")
    out = []
    for start in range(0, len(codes), batch):
        chunk = np.asarray(codes[start : start + batch])
        pad = np.concatenate([chunk, np.repeat(chunk[-1:], batch - len(chunk), 0)])
        out.append(np.asarray(fn(state, pad))[: len(chunk)])
    return np.concatenate(out)
