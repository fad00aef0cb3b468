"""Stage 1 on its own: fit the built-in data's image tokenizer (`data.tokenizer`) with a run store
and a tracker run of its own, and measure it on held-out renders.

`dalle-ablate train-tokenizer [overrides]` runs it into `outputs/tokenizers/<tokenizer>-<key>/`;
`python run.py data.tokenizer=dvae` runs it into `<job>/tokenizer/` first when the tokenizer of
its settings is not cached yet. Either way the fitted tokenizer lands in the cache
(`<data.cache_dir>/<tokenizer>/<key>.npz`) and every later run of those settings loads it.

What is measured (run store summary and the closing lines): the `shapes` parser on the
reconstructions of the valid split's renders (what a perfect stage 2 could at best draw), their
per-pixel MSE, and the codebook's use on them (perplexity of the code histogram, codes used).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from dalle_ablate.data.dvae import perplexity
from dalle_ablate.data.image_tokenizer import IMAGE_TOKENIZERS
from dalle_ablate.data.shapes import build_tokenizer, generate_split, scenes_key
from dalle_ablate.evaluate.shapes_parser import accuracy
from dalle_ablate.fileio import shown
from dalle_ablate.registry import ConfigError
from dalle_ablate.track import build_tracker
from dalle_ablate.track.base import ends_on_error
from dalle_ablate.train.meta import git_commit


@dataclass
class TokenizerResult:
    run_dir: Path
    path: Path  # the cached tokenizer
    trained: bool  # False: loaded from the cache
    summary: dict


def tokenizer_cached(data_cfg) -> bool:
    option = IMAGE_TOKENIZERS.get(data_cfg.tokenizer)
    return data_cfg.tokenizer == "vqgan" or option.path(data_cfg, scenes_key(data_cfg)).is_file()


def side_by_side(originals: np.ndarray, recons: np.ndarray, n: int = 8) -> np.ndarray:
    """Two rows: originals above their reconstructions, one pixel of grey between images."""
    a, b = originals[:n], recons[:n]
    s = a.shape[1]
    out = np.full((2 * s + 3, n * (s + 1) + 1, 3), 128, np.uint8)
    for i in range(len(a)):
        x = 1 + i * (s + 1)
        out[1 : 1 + s, x : x + s] = a[i]
        out[2 + s : 2 + 2 * s, x : x + s] = b[i]
    return out


def train_tokenizer(
    cfg, run_dir: Path, name: Optional[str] = None, group: Optional[str] = None, overrides: Optional[list[str]] = None
) -> TokenizerResult:
    data = cfg.data
    if data.name != "shapes":
        raise ConfigError(
            f"train-tokenizer fits the built-in data's image tokenizer (data=shapes); data={data.name} comes encoded"
        )
    option = IMAGE_TOKENIZERS.get(data.tokenizer)
    scenes = scenes_key(data)
    key = option.key(data, scenes)
    trained = not tokenizer_cached(data)
    meta = {
        "overrides": list(overrides or []),
        "git": git_commit(),
        "tokenizer": data.tokenizer,
        "tokenizer_key": key,
        "scenes_key": scenes,
    }
    tracker = build_tracker(
        cfg.tracker,
        run_dir,
        dataclasses.asdict(cfg),
        meta,
        name=name or f"tokenizer {data.tokenizer} {key}",
        group=group,
        job_type="tokenizer",
    )
    t0, last = time.perf_counter(), [0]

    def log(step: int, row: dict) -> None:
        last[0] = step
        tracker.log(row, step)

    with ends_on_error(tracker):
        tokenizer = build_tokenizer(data, log=log)
        specs, images = generate_split(data, "valid")
        codes = tokenizer.encode(images)
        recons = tokenizer.decode(codes)
        parsed = accuracy(recons, specs)
        summary = {
            "tokenizer/parser_all": parsed["all"],
            "tokenizer/parser_all_lo": parsed["all_lo"],
            "tokenizer/parser_all_hi": parsed["all_hi"],
            **{f"tokenizer/parser_{k}": parsed[k] for k in ("color", "shape", "size", "position", "count")},
            "tokenizer/valid_mse": float(((recons.astype(np.float64) - images) ** 2).mean() / 255.0**2),
            "tokenizer/valid_perplexity": perplexity(codes, tokenizer.size),
            "tokenizer/codes_used": int(len(np.unique(codes))),
            "tokenizer/codebook_size": tokenizer.size,
            "tokenizer/grid": list(tokenizer.grid),
            "tokenizer/valid_n": len(images),
            "tokenizer/trained": trained,
            "wall_time": time.perf_counter() - t0,
        }
        tracker.log({k: v for k, v in summary.items() if isinstance(v, float)}, last[0])
        tracker.log_image(
            "tokenizer/reconstructions",
            side_by_side(images, recons),
            last[0],
            caption="valid renders (top) and their reconstructions (bottom)",
        )
        tracker.log_summary(summary)
        tracker.finish("finished")
    return TokenizerResult(run_dir, option.path(data, scenes), trained, summary)


def closing_lines(cfg, result: TokenizerResult) -> str:
    s = result.summary
    return "\n".join(
        [
            f"{'trained' if result.trained else 'loaded'} data.tokenizer={cfg.data.tokenizer} in {s['wall_time']:.1f} s: {result.path}",
            f"  held-out reconstructions ({s['tokenizer/valid_n']} valid renders): shapes parser all-correct "
            f"{s['tokenizer/parser_all']:.1%} [{s['tokenizer/parser_all_lo']:.1%}, {s['tokenizer/parser_all_hi']:.1%}], "
            f"MSE {s['tokenizer/valid_mse']:.2e}",
            f"  codebook: perplexity {s['tokenizer/valid_perplexity']:.1f} of {s['tokenizer/codebook_size']} codes "
            f"({s['tokenizer/codes_used']} used), grid {s['tokenizer/grid'][0]}x{s['tokenizer/grid'][1]}",
            f"  run store {shown(result.run_dir)}",
        ]
    )
