"""`dalle-ablate encode --images FOLDER --vqgan WEIGHTS --out DIR`: a folder of images with their
captions -> dalle-mini's parquet format (a caption column and a list of VQGAN codes per row),
which `data=parquet` trains on. Each image `x.jpg` / `x.png` / `x.webp` has its caption in `x.txt`
(the layout img2dataset writes). Images are resized so the shorter side is the VQGAN's
resolution (bicubic) and centre-cropped, as dalle-mini's encoding notebook did."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image
from tqdm.auto import tqdm

from dalle_ablate.data.parquet import write_parquet
from dalle_ablate.registry import ConfigError
from dalle_ablate.vqgan.codes import encode_images

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
        raise ConfigError(
            f"--images {folder}: {len(missing)} images have no caption file, e.g. {missing[0]} needs "
            f"{Path(missing[0]).with_suffix('.txt')}"
        )
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


def encode_folder(folder: str | Path, vqgan, out: str | Path, batch: int = 16, progress: bool = True) -> Path:
    """Encode every image of `folder`; write `out/data.parquet`. Returns its path."""
    pairs = image_caption_pairs(folder)
    size = vqgan.cfg.resolution
    codes = []
    for start in tqdm(
        range(0, len(pairs), batch), total=-(-len(pairs) // batch), unit="batch", disable=not progress, desc="encoding"
    ):
        images = np.stack([load_square(p, size) for p, _ in pairs[start : start + batch]])
        codes.append(encode_images(vqgan, images, batch))
    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "data.parquet"
    write_parquet(path, [c for _, c in pairs], np.concatenate(codes))
    return path
