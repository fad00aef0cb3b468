"""An exact parser of shapes images and a GenEval-style score against the caption's scene spec.

Parsing (no learned model, so it cannot drift with training):
- Pixels: every rendered pixel is a blend of one palette colour P and the white background W
  (anti-aliasing), x = W + c (P - W). For each colour the best coverage c in [0, 1] and the
  distance of x from that blend are computed; the pixel belongs to the colour whose blend fits
  best, is background when that colour's coverage is below one half, and is `other` (no palette
  colour) when even the best blend is more than `MAX_BLEND_DIST` away (a black or brown object
  is not "green"). Snapping to the nearest palette colour instead turned red edge pixels orange
  at 0.44-0.74 coverage.
- Objects: the connected components of each colour. A component's shape is the template (circle,
  square, triangle, rendered exactly as the data renders them) that fits it best over a range of
  sizes around its bounding box, so shape is named independently of size; its size is then the
  nearer of the data's two sizes to the fitted one. Matching shape and size jointly against the
  two data sizes only misnamed 16 of 42 correct shapes of in-between sizes.

Scoring follows GenEval (Ghosh et al. 2023, arXiv 2310.11513): an image is correct when every
constraint its caption states holds -- the number of objects, each object's stated colour,
shape, size and grid position, and the stated relation. Caption objects are matched one to one
to detected objects once per image (`match`: the fewest wrong stated attributes, the relation
breaking ties), and every rate is read off that one matching: per attribute, objects the caption
states but the image lacks count as wrong, and every extra detected object counts as one more
wrong check, so clutter never raises a rate; DSG's conditional rates (Cho et al. 2024, arXiv
2310.18235) ask an attribute only of objects that were found, VISOR's (Gokhale et al. 2022,
arXiv 2212.10015) the relation only where both its objects were. A caption that does not belong
to its image scores the rule's chance (`chance`, tests/evaluate/test_evaluate.py): for one
object a uniform guess of each attribute; with several, above it, because the matching a wrong
caption gets is its best one. No rule can do better and still give a right image 1.0: for "a
red square and a blue square" the image of a red and a blue square is the same whichever
object is which, so it must score as well as the wrong image it would be under the other
matching (docs/architecture.md, "The shapes evaluation", has the values).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import numpy as np
from scipy import ndimage
from scipy.optimize import linear_sum_assignment
from scipy.stats import binomtest

from dalle_ablate.data.scenes import BACKGROUND, PALETTE, SHAPES, SIZES, TIERS, shape_mask_r, tier
from dalle_ablate.evaluate.evaluators import evaluator

COLORS = list(PALETTE)
_W = np.array(BACKGROUND, np.float32)
_P = np.array(list(PALETTE.values()), np.float32) - _W  # [6, 3] palette colours relative to white
OTHER = len(COLORS) + 1  # label of pixels that no blend of a palette colour with white explains
# RGB distance from the best colour-with-white blend above which a pixel is `other`. Rendered
# pixels fit exactly (distance < 2); a patch codebook's reconstructions blend a little (measured
# up to ~35 at shape edges); palette colours are 100-250 apart, black is 140+ from every blend.
MAX_BLEND_DIST = 60.0
MIN_AREA = 16  # pixels; the smallest object (a small triangle at 48 px) covers about 25
# A component is an object only if some template fits it this well: stray patches of a blended
# colour at a shape's edge fit none (IoU 0.3-0.45 measured on reconstructions), the smallest
# real objects fit with 0.65 and more.
MIN_IOU = 0.5
ATTRIBUTES = ("color", "shape", "size", "position")
# Sizes tried around a component's bounding-box estimate, as factors of the estimated half-extent,
# kept within EXTENT_RANGE (fractions of the data's smallest and largest half-extent): any size in
# between is named right, and stray blobs much smaller than the smallest object fit nothing.
_SCALES = np.linspace(0.8, 1.25, 10)
EXTENT_RANGE = (0.85, 1.15)
_SIZE_NAMES = sorted(SIZES, key=SIZES.get)  # small, large
# Boundary between the data's sizes: the geometric mean of their half-extents.
_SIZE_CUT = float(np.sqrt(np.prod([SIZES[n] for n in _SIZE_NAMES])))


@dataclass(frozen=True)
class Detected:
    color: str
    shape: str
    size: str
    row: int
    col: int
    cx: float  # centroid, pixels
    cy: float
    area: int
    iou: float  # of the best template: how shape-like the component is
    extent: float  # fitted half-extent as a fraction of a grid cell's width


def snap(image: np.ndarray) -> np.ndarray:
    """[H, W] labels: 0 background, 1..6 the palette colours, OTHER for pixels no blend of a
    palette colour with white explains."""
    x = image.astype(np.float32) - _W  # [H, W, 3]
    cov = np.clip(np.einsum("hwc,pc->hwp", x, _P) / (_P**2).sum(-1), 0.0, 1.0)  # [H, W, 6]
    dist = np.linalg.norm(x[..., None, :] - cov[..., None] * _P, axis=-1)  # [H, W, 6]
    best = dist.argmin(-1)
    c = np.take_along_axis(cov, best[..., None], -1)[..., 0]
    d = np.take_along_axis(dist, best[..., None], -1)[..., 0]
    labels = np.where(c >= 0.5, best + 1, 0)
    return np.where(d > MAX_BLEND_DIST, OTHER, labels)


@lru_cache(maxsize=65536)
def _template(shape: str, r4: int, cx2: int, cy2: int, image_size: int) -> np.ndarray:
    return shape_mask_r(shape, r4 / 4, cx2 / 2, cy2 / 2, image_size)


def parse(image: np.ndarray, min_area: int = MIN_AREA, min_iou: float = MIN_IOU) -> list[Detected]:
    """The objects in one [S, S, 3] uint8 image, in raster order of their colour components."""
    s = image.shape[0]
    labels = snap(image)
    cell = s / 3
    lo, hi = EXTENT_RANGE[0] * min(SIZES.values()) * cell, EXTENT_RANGE[1] * max(SIZES.values()) * cell
    found = []
    # Objects of the data never touch (a gap of at least a quarter cell): a component that touches
    # a larger one of another colour is that one's quantised edge (a patch codebook renders part
    # of an orange edge yellow), not an object.
    coloured = (labels >= 1) & (labels <= len(COLORS))
    all_comps, _ = ndimage.label(coloured, structure=np.ones((3, 3)))
    for ci, color in enumerate(COLORS, start=1):
        comps, n = ndimage.label(labels == ci)
        for k in range(1, n + 1):
            mask = comps == k
            area = int(mask.sum())
            if area < min_area:
                continue
            blob = all_comps == all_comps[mask][0]
            if int(blob.sum()) >= 2 * area:
                continue
            ys, xs = np.nonzero(mask)
            # Templates are centred on the bounding box (for a triangle its box is the square's),
            # whose half-width estimates the half-extent.
            bx, by = (xs.min() + xs.max() + 1) / 2, (ys.min() + ys.max() + 1) / 2
            r0 = (xs.max() - xs.min() + ys.max() - ys.min() + 2) / 4
            radii = sorted({round(4 * min(max(r0 * f, lo), hi)) for f in _SCALES})  # quarter pixels
            best = max(
                ((_iou(mask, _template(sh, r4, round(bx * 2), round(by * 2), s)), sh, r4) for sh in SHAPES for r4 in radii),
                key=lambda t: t[0],
            )
            if best[0] < min_iou:
                continue
            extent = best[2] / 4 / cell
            size = _SIZE_NAMES[0] if extent < _SIZE_CUT else _SIZE_NAMES[-1]
            cx, cy = xs.mean() + 0.5, ys.mean() + 0.5
            found.append(Detected(color, best[1], size, min(int(cy // cell), 2), min(int(cx // cell), 2),
                                  float(cx), float(cy), area, float(best[0]), float(extent)))
    return found


def _iou(a: np.ndarray, b: np.ndarray) -> float:
    union = np.logical_or(a, b).sum()
    return float(np.logical_and(a, b).sum() / union) if union else 0.0


def _wrong(obj: dict, det: Optional[Detected], attrs=ATTRIBUTES) -> list[str]:
    """The stated attributes (among `attrs`) of a spec object that a detected object gets wrong;
    all of them when it has no detected object."""
    said = [a for a in attrs if a in obj["said"]]
    if det is None:
        return said
    value = {"color": det.color, "shape": det.shape, "size": det.size, "position": (det.row, det.col)}
    truth = {"color": obj["color"], "shape": obj["shape"], "size": obj["size"], "position": (obj["row"], obj["col"])}
    return [a for a in said if value[a] != truth[a]]


def _relation_holds(rel: str, a: Detected, b: Detected) -> bool:
    return {"left of": a.col < b.col, "right of": a.col > b.col, "above": a.row < b.row, "below": a.row > b.row}[rel]


def _assignments(objects: list[dict], detected: list[Detected]):
    """Every one-to-one assignment of spec objects to detected objects (None = missing), in a
    fixed order."""
    slots: list[Optional[Detected]] = list(detected) + [None] * len(objects)
    seen = set()
    for chosen in itertools.permutations(range(len(slots)), len(objects)):
        key = tuple(i if i < len(detected) else None for i in chosen)
        if key not in seen:
            seen.add(key)
            yield tuple(slots[i] if i < len(detected) else None for i in chosen)


def _cost(obj: dict, det: Optional[Detected]) -> int:
    """Wrong stated attributes; a missing object costs one more than all of them, so a matching
    always gives a caption object a detected one while any is left."""
    return len(_wrong(obj, det)) + (det is None)


def match(objects: list[dict], detected: list[Detected], relation: Optional[dict]) -> tuple[tuple, bool]:
    """(the matching, whether the relation holds under it): the one matching of caption objects
    to detected objects (None = missing) with the fewest wrong stated attributes, among those the
    relation's holding breaking ties (so a relation cannot buy a wrong attribute: a wrong caption's
    relation holds 0.50 of the time, not 0.58 as when it counts like an attribute); every rate of the image is read off it. Without a
    relation, scipy's linear_sum_assignment (deterministic); with one (two caption objects),
    exhaustively, the first best in a fixed order."""
    if relation is None:
        cost = np.array([[_cost(o, d) for d in [*detected, *[None] * len(objects)]] for o in objects])
        rows, cols = linear_sum_assignment(cost)
        chosen = [None] * len(objects)
        for r, c in zip(rows, cols):
            chosen[r] = detected[c] if c < len(detected) else None
        return tuple(chosen), True
    best = None
    for chosen in _assignments(objects, detected):
        a, b = chosen[relation["subject"]], chosen[relation["object"]]
        rel_ok = a is not None and b is not None and _relation_holds(relation["rel"], a, b)
        wrong = (sum(_cost(o, d) for o, d in zip(objects, chosen)), not rel_ok)
        if best is None or wrong < best[0]:
            best = (wrong, chosen, rel_ok)
    return best[1], best[2]


def score(detected: list[Detected], spec: dict) -> dict[str, tuple[int, int]]:
    """{constraint: (correct, checked)} for one image against its scene spec, all read off one
    matching (`match`):
    - each stated attribute, unconditionally: a missing object's attributes are wrong and every
      extra detected object adds one wrong check, so clutter never raises a rate;
    - `<attribute>_if_found`: the same checks of the caption objects the matching gives a
      detected object (DSG: an attribute is asked only of an object that is there);
    - `found`: caption objects given a detected object; `count`: exactly as many objects;
    - with a relation: `relation`, `relation_coverage` (both of its objects found) and
      `relation_if_found` (the relation among images where both are: VISOR's conditional);
    - `all`: every one of these right, exact count (GenEval's image-level verdict)."""
    objects = spec["objects"]
    relation = spec.get("relation")
    chosen, rel_ok = match(objects, detected, relation)
    extras = max(0, len(detected) - len(objects))
    out: dict[str, tuple[int, int]] = {}
    for attr in ATTRIBUTES:
        said = [(o, d) for o, d in zip(objects, chosen) if attr in o["said"]]
        if not said:
            continue
        right = [d is not None and not _wrong(o, d, (attr,)) for o, d in said]
        out[attr] = (sum(right), len(said) + extras)
        out[f"{attr}_if_found"] = (sum(right), sum(d is not None for _, d in said))
    out["found"] = (sum(d is not None for d in chosen), len(objects))
    count_ok = len(detected) == len(objects)
    out["count"] = (int(count_ok), 1)
    if relation is not None:
        both = chosen[relation["subject"]] is not None and chosen[relation["object"]] is not None
        out["relation"] = (int(rel_ok), 1)
        out["relation_coverage"] = (int(both), 1)
        out["relation_if_found"] = (int(rel_ok), int(both))
    all_right = not any(_wrong(o, d) for o, d in zip(objects, chosen))
    out["all"] = (int(count_ok and rel_ok and all_right), 1)
    return out


def from_spec(spec: dict) -> list[Detected]:
    """The objects an exact render of `spec` parses into (tests/evaluate: renders parse exactly),
    without rendering."""
    return [Detected(o["color"], o["shape"], o["size"], o["row"], o["col"], 0.0, 0.0, 0, 1.0, SIZES[o["size"]])
            for o in spec["objects"]]


@lru_cache(maxsize=None)
def chance(name: str, pairs: int = 20000, seed: int = 0) -> dict[str, float]:
    """The rates a caption earns on an image it does not belong to, tier `name`: the mean over
    `pairs` independent (image, caption) pairs of evaluation prompts of that tier, the image an
    exact render of its scene. What "at chance" means for this rule on this tier: one object's
    attributes are 1/6, 1/3, 1/2 and 1/9 (uniform draws); with several objects the one matching
    picks the assignment with the fewest wrong constraints, which a wrong caption also profits
    from (docs/architecture.md, "The shapes evaluation", gives the values). Monte Carlo standard
    error at most sqrt(0.25 / pairs)."""
    from dalle_ablate.data.shapes import tier_prompt

    rng = np.random.default_rng([seed, TIERS.index(name)])
    totals: dict[str, list[int]] = {}
    for _ in range(pairs):
        image, caption = tier_prompt(rng, name), tier_prompt(rng, name)
        for k, (c, n) in score(from_spec(image), caption).items():
            a = totals.setdefault(k, [0, 0])
            a[0] += c
            a[1] += n
    return {k: c / n for k, (c, n) in totals.items() if n}


# -- difficulty tiers ---------------------------------------------------------------------------
def wilson(correct: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a rate (scipy's binomtest); (nan, nan) when n is 0."""
    if n == 0:
        return float("nan"), float("nan")
    ci = binomtest(int(correct), int(n)).proportion_ci(confidence_level=confidence, method="wilson")
    return float(ci.low), float(ci.high)


def _rates(totals: dict[str, list[int]], prefix: str = "") -> dict[str, float]:
    out = {}
    for k, (c, n) in totals.items():
        if n:
            out[f"{prefix}{k}"] = c / n
            out[f"{prefix}{k}_lo"], out[f"{prefix}{k}_hi"] = wilson(c, n)
    return out


def accuracy(images: np.ndarray, specs: list[dict]) -> dict[str, float]:
    """Accuracy per constraint with its 95% Wilson interval (`<k>_lo`, `<k>_hi`), over all images
    and per difficulty tier (`<tier>/<k>`, `<tier>/n`); `clean` (share of drawn pixels in
    well-formed objects) and `n` (images scored). An image counts once per constraint (`all`,
    `count`, `relation`); attribute rates count object checks."""
    totals: dict[str, list[int]] = {}
    per_tier: dict[str, dict[str, list[int]]] = {}
    clean = []
    for image, spec in zip(images, specs):
        found = parse(image)
        # Fidelity without the caption: the share of drawn (non-background) pixels that belong
        # to a well-formed object. 1 for real renders; junk and broken shapes lower it.
        drawn = int((snap(image) != 0).sum())
        clean.append(sum(d.area for d in found) / drawn if drawn else 1.0)
        t = per_tier.setdefault(tier(spec), {"n": [0, 0]})
        t["n"][0] += 1
        for k, (c, n) in score(found, spec).items():
            for acc in (totals, t):
                a = acc.setdefault(k, [0, 0])
                a[0] += c
                a[1] += n
    out = _rates(totals)
    for name in TIERS:
        if name in per_tier:
            counts = per_tier[name]
            out[f"{name}/n"] = float(counts.pop("n")[0])
            out.update(_rates(counts, f"{name}/"))
    out["clean"] = float(np.mean(clean)) if clean else float("nan")
    out["n"] = float(len(specs))
    return out


@evaluator("shapes", "samples", needs_specs=True)
def shapes_evaluator(images: np.ndarray, ctx) -> dict[str, float]:
    """eval.metrics=[shapes]: the images parsed and scored against their captions' scene specs."""
    return accuracy(images, ctx.specs)
