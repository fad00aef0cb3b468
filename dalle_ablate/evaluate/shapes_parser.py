"""An exact parser of shapes images and a GenEval-style score against the caption's scene spec.

Parsing (no learned model, so it cannot drift with training):
- Pixels: every rendered pixel is a blend of one palette colour P and the white background W
  (anti-aliasing), x = W + c (P - W). For each colour the best coverage c in [0, 1] and the
  distance of x from that blend are computed; the pixel belongs to the colour whose blend fits
  best, is background when that colour's coverage is below one half, and is `other` (no palette
  colour) when even the best blend is more than `MAX_BLEND_DIST` away (a black or brown object
  is not "green"). Snapping to the nearest palette colour instead turned red edge pixels orange
  at 0.44-0.74 coverage.
- Objects: the connected components of each colour, each judged on its own (shapes of
  different colours that touch are separated). A component's shape is the one (circle, square,
  triangle, drawn exactly as the data draws them) whose coverage map best matches the
  component's, placed by moments and refined to an eighth of a pixel (`fit`), so shape is named
  independently of size, down to the smallest object named (MIN_AREA pixels, a 4x4 block); its
  size is then the nearer of the data's two sizes to the fitted one. A component that no shape
  explains to MIN_IOU (a semicircle, an arch, a notched circle, a bar) is no object.
- Unparsed ink: whatever ink is left once the objects are taken out (malformed shapes, blots,
  pieces of a shape under another, colours of no palette), after a 2x2 opening that removes
  one-pixel slivers, makes the image `unparsed` when it reaches STRAY_MIN pixels; such an image
  is never all-correct.

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

from dalle_ablate.data.scenes import BACKGROUND, PALETTE, SHAPES, SIZES, TIERS, shape_coverage, tier
from dalle_ablate.evaluate.evaluators import SamplesContext, evaluator
from dalle_ablate.metrics import Metric

COLORS = list(PALETTE)
_W = np.array(BACKGROUND, np.float32)
_P = np.array(list(PALETTE.values()), np.float32) - _W  # [6, 3] palette colours relative to white
OTHER = len(COLORS) + 1  # label of pixels that no blend of a palette colour with white explains
# RGB distance from the best colour-with-white blend above which a pixel is `other`. Rendered
# pixels fit exactly (distance < 2); a patch codebook's reconstructions blend a little (measured
# up to ~35 at shape edges); palette colours are 100-250 apart, black is 140+ from every blend.
MAX_BLEND_DIST = 60.0
MIN_AREA = 16  # pixels: a 4x4 block; the smallest object of the data (a small triangle at 48 px) covers about 25
# A component is an object only if some shape, drawn as the data draws it, explains its coverage
# this well (`fit`: soft IoU). Every render of every shape, from the smallest the parser names
# (MIN_AREA) to 1.15 x the large size, at any sub-pixel position, fits with 0.997 or more at 48
# and 64 px; a semicircle, an arch, a circle with a 45-degree wedge or a square bite taken out, a
# bar or an L-shape with at most 0.85, a square with a rounded top with 0.90
# (measured on renders; tests/evaluate/test_evaluate.py checks both sides of the threshold).
MIN_IOU = 0.95
# Ink left over once the objects are taken out is `unparsed` when at least this many pixels of it
# survive a 2x2 opening (which removes one-pixel slivers along a shape's edge, where a patch
# codebook blends two colours into a third): half the smallest object the parser names.
STRAY_MIN = MIN_AREA // 2
ATTRIBUTES = ("color", "shape", "size", "position")
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


def _blend(image: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per pixel: the palette colour (0..5) whose blend with white fits best, its coverage in
    [0, 1] and the RGB distance of the pixel from that blend."""
    x = image.astype(np.float32) - _W  # [H, W, 3]
    cov = np.clip(np.einsum("hwc,pc->hwp", x, _P) / (_P**2).sum(-1), 0.0, 1.0)  # [H, W, 6]
    dist = np.linalg.norm(x[..., None, :] - cov[..., None] * _P, axis=-1)  # [H, W, 6]
    best = dist.argmin(-1)
    c = np.take_along_axis(cov, best[..., None], -1)[..., 0]
    d = np.take_along_axis(dist, best[..., None], -1)[..., 0]
    return best, c, d


def _labels(best: np.ndarray, c: np.ndarray, d: np.ndarray) -> np.ndarray:
    return np.where(d > MAX_BLEND_DIST, OTHER, np.where(c >= 0.5, best + 1, 0))


def snap(image: np.ndarray) -> np.ndarray:
    """[H, W] labels: 0 background, 1..6 the palette colours, OTHER for pixels no blend of a
    palette colour with white explains."""
    return _labels(*_blend(image))


# A shape's centre relative to the centroid of its area, in half-extents: the triangle is upright
# with its apex at the top of its box, so its centroid lies a third of r below the box's centre.
_CENTROID_DY = {"circle": 0.0, "square": 0.0, "triangle": 1 / 3}
_AREA = {"circle": np.pi, "square": 4.0, "triangle": 2.0}  # area / r^2
_R_MOVES = [(k / 16, 0.0, 0.0) for k in range(-6, 3)]  # pixels
_XY_MOVES = [(0.0, i / 8, j / 8) for i in range(-2, 3) for j in range(-2, 3)]


def _window(cover: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """The square of `cover` around a component, with a margin of half its size (zeros outside
    the image): fitting in it costs a fraction of fitting in the whole image, and a template
    that fits at all lies inside it."""
    ys, xs = np.nonzero(mask)
    side = max(ys.max() - ys.min(), xs.max() - xs.min()) + 1
    m = side // 2 + 2
    y0, x0 = ys.min() - m, xs.min() - m
    w = side + 2 * m
    pad = np.pad(cover, w)
    return pad[y0 + w : y0 + 2 * w, x0 + w : x0 + 2 * w]


def fit(cover: np.ndarray) -> tuple[float, str, float]:
    """(soft IoU, shape, half-extent in pixels) of the shape that best explains a component's
    coverage map ([S, S] in [0, 1], anti-aliased edges included). Each shape is placed by moments
    -- its half-extent from the covered area, its centre from the centroid -- and drawn as the
    data draws it, so a render of any size at any sub-pixel position fits almost exactly; the fit
    is sum(min) / sum(max) of the two coverage maps, so a bite out of a shape costs its area
    whatever the shape's size (a binary IoU on half-covered pixels let small shapes vary by 0.1)."""
    s = cover.shape[0]
    area = float(cover.sum())
    grid = np.arange(s) + 0.5
    mx = float((cover.sum(0) * grid).sum() / area)
    my = float((cover.sum(1) * grid).sum() / area)

    def iou(sh: str, r: float, x: float, y: float) -> float:  # (x, y): the shape's centroid
        tmpl = shape_coverage(sh, r, x, y - _CENTROID_DY[sh] * r, s).astype(np.float32) / 255
        return float(np.minimum(cover, tmpl).sum() / np.maximum(cover, tmpl).sum())

    best = (-1.0, "", 0.0)
    for sh in SHAPES:
        at = (float(np.sqrt(area / _AREA[sh])), mx, my)
        got = iou(sh, *at)
        if got < best[0] - 0.15:  # far behind the best shape so far: the search will not close the gap
            continue
        # then searched near there, on a grid finer than the renderer's (PIL places outlines on a
        # quarter-pixel grid, so a hill-climb stalls on its plateaus): rasterisation draws small
        # shapes larger than r^2 x const, a sample's shape may sit off its centroid
        for moves in (_R_MOVES, _XY_MOVES, _R_MOVES):
            got, at = max(
                (
                    (iou(sh, at[0] + dr, at[1] + dx, at[2] + dy), (at[0] + dr, at[1] + dx, at[2] + dy))
                    for dr, dx, dy in moves
                    if at[0] + dr > 0
                ),
                key=lambda t: t[0],
            )
        if got > best[0]:
            best = (got, sh, at[0])
    return best


@dataclass(frozen=True)
class Parsed:
    objects: list  # [Detected], in raster order of their colour components
    stray: int  # pixels of ink in no object, after a 2x2 opening (one-pixel slivers removed)
    drawn: int  # pixels that are not background

    @property
    def unparsed(self) -> bool:
        """Ink that is no recognised object: a malformed shape, a bar, a blot, a colour of no palette."""
        return self.stray >= STRAY_MIN


def parse_image(image: np.ndarray, min_area: int = MIN_AREA, min_iou: float = MIN_IOU) -> Parsed:
    """The objects in one [S, S, 3] uint8 image and the ink left over. Each colour's connected
    components are judged on their own, so shapes of different colours that touch are separated
    (each is an object if it fits a shape) and a piece that fits none is left-over ink, never
    silently dropped."""
    from scipy import ndimage  # here: importing the evaluators (every run, `--help`) does not pay for scipy

    s = image.shape[0]
    best, c, d = _blend(image)
    labels = _labels(best, c, d)
    cell = s / 3
    found, taken = [], np.zeros(labels.shape, bool)
    for ci, color in enumerate(COLORS, start=1):
        comps, n = ndimage.label(labels == ci)
        for k in range(1, n + 1):
            mask = comps == k
            area = int(mask.sum())
            if area < min_area:
                continue
            # its coverage, with the faint edge pixels of its colour around it (under half covered),
            # relative to its inside's (a lighter red is a red drawn at less than full strength)
            near = ndimage.binary_dilation(mask, np.ones((3, 3))) & (mask | (labels == 0) & (best == ci - 1))
            cover = np.clip(np.where(near, c, 0.0) / np.percentile(c[mask], 90), 0.0, 1.0).astype(np.float32)
            iou, shape, r = fit(_window(cover, mask))
            if iou < min_iou:
                continue
            taken |= mask
            ys, xs = np.nonzero(mask)
            extent = r / cell
            size = _SIZE_NAMES[0] if extent < _SIZE_CUT else _SIZE_NAMES[-1]
            cx, cy = xs.mean() + 0.5, ys.mean() + 0.5
            found.append(
                Detected(
                    color,
                    shape,
                    size,
                    min(int(cy // cell), 2),
                    min(int(cx // cell), 2),
                    float(cx),
                    float(cy),
                    area,
                    float(iou),
                    float(extent),
                )
            )
    ink = labels != 0
    stray = ndimage.binary_opening(ink & ~taken, structure=np.ones((2, 2)))
    return Parsed(found, int(stray.sum()), int(ink.sum()))


def parse(image: np.ndarray, min_area: int = MIN_AREA, min_iou: float = MIN_IOU) -> list[Detected]:
    """The objects in one [S, S, 3] uint8 image, in raster order of their colour components."""
    return parse_image(image, min_area, min_iou).objects


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
        from scipy.optimize import linear_sum_assignment

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


def score(detected: list[Detected], spec: dict, unparsed: bool = False) -> dict[str, tuple[int, int]]:
    """{constraint: (correct, checked)} for one image against its scene spec, all read off one
    matching (`match`):
    - each stated attribute, unconditionally: a missing object's attributes are wrong and every
      extra detected object adds one wrong check, so clutter never raises a rate;
    - `<attribute>_if_found`: the same checks of the caption objects the matching gives a
      detected object (DSG: an attribute is asked only of an object that is there);
    - `found`: caption objects given a detected object; `count`: exactly as many objects;
    - with a relation: `relation`, `relation_coverage` (both of its objects found) and
      `relation_if_found` (the relation among images where both are: VISOR's conditional);
    - `unparsed`: the image has ink that is no recognised object (`Parsed.unparsed`);
    - `all`: every one of these right, exact count, no unparsed ink (GenEval's image-level verdict)."""
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
    out["unparsed"] = (int(unparsed), 1)
    out["all"] = (int(count_ok and rel_ok and all_right and not unparsed), 1)
    return out


def from_spec(spec: dict) -> list[Detected]:
    """The objects an exact render of `spec` parses into (tests/evaluate: renders parse exactly),
    without rendering."""
    return [
        Detected(o["color"], o["shape"], o["size"], o["row"], o["col"], 0.0, 0.0, 0, 1.0, SIZES[o["size"]])
        for o in spec["objects"]
    ]


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
    from scipy.stats import binomtest

    ci = binomtest(int(correct), int(n)).proportion_ci(confidence_level=confidence, method="wilson")
    return float(ci.low), float(ci.high)


BOOTSTRAP = 2000  # resamples of the prompts behind an attribute rate's interval


def _rates(per_image: list[dict[str, tuple[int, int]]], prefix: str = "") -> dict[str, float]:
    """Each constraint's rate over these images with its 95% interval over prompts: Wilson where
    an image is one check (`all`, `count`, `relation`, ...), else (attributes: one check per
    object, correlated within an image) a percentile bootstrap that resamples whole images
    (BOOTSTRAP resamples, a fixed seed: the same images give the same interval)."""
    out: dict[str, float] = {}
    keys = list(dict.fromkeys(k for v in per_image for k in v))
    rng = np.random.default_rng(0)
    picks = rng.integers(0, len(per_image), (BOOTSTRAP, len(per_image))) if per_image else None
    for k in keys:
        c = np.array([v.get(k, (0, 0))[0] for v in per_image])
        n = np.array([v.get(k, (0, 0))[1] for v in per_image])
        if not n.sum():
            continue
        out[f"{prefix}{k}"] = c.sum() / n.sum()
        if n.max() <= 1:
            out[f"{prefix}{k}_lo"], out[f"{prefix}{k}_hi"] = wilson(c.sum(), n.sum())
        else:
            with np.errstate(invalid="ignore", divide="ignore"):
                boot = c[picks].sum(1) / n[picks].sum(1)
            lo, hi = np.nanpercentile(boot, [2.5, 97.5])
            out[f"{prefix}{k}_lo"], out[f"{prefix}{k}_hi"] = float(lo), float(hi)
    return out


def accuracy(images: np.ndarray, specs: list[dict], parsed: Optional[list[Parsed]] = None) -> dict:
    """Accuracy per constraint with its 95% interval over prompts (`<k>_lo`, `<k>_hi`; `_rates`),
    over all images and per difficulty tier (`<tier>/<k>`, `<tier>/n`); `clean` (share of drawn
    pixels in well-formed objects), `n` (images scored) and `verdicts` (`<tier>/verdicts`): each
    image's `all`, "1" or "0", in the images' order, for comparisons prompt by prompt between
    runs scored on the same prompts. An image counts once per constraint (`all`, `count`,
    `relation`); attribute rates count object checks. `parsed`: the images' parses, when they are
    at hand (scoring other captions on the same images)."""
    scores, tiers, clean = [], [], []
    for i, spec in enumerate(specs):
        parsed_i = parse_image(images[i]) if parsed is None else parsed[i]
        # Fidelity without the caption: the share of drawn (non-background) pixels that belong
        # to a well-formed object. 1 for real renders; junk and broken shapes lower it.
        clean.append(sum(d.area for d in parsed_i.objects) / parsed_i.drawn if parsed_i.drawn else 1.0)
        scores.append(score(parsed_i.objects, spec, parsed_i.unparsed))
        tiers.append(tier(spec))
    out: dict = _rates(scores)
    out["verdicts"] = "".join(str(v["all"][0]) for v in scores)
    for name in TIERS:
        mine = [v for v, t in zip(scores, tiers) if t == name]
        if mine:
            out[f"{name}/n"] = float(len(mine))
            out.update(_rates(mine, f"{name}/"))
            out[f"{name}/verdicts"] = "".join(str(v["all"][0]) for v in mine)
    out["clean"] = float(np.mean(clean)) if clean else float("nan")
    out["n"] = float(len(specs))
    return out


@evaluator(
    "shapes",
    "samples",
    needs_specs=True,
    metrics=[
        Metric(
            "all",
            "shapes all-correct (every attribute, the count and the relation right)",
            "fraction of prompts",
            "higher",
            headline=3,
            study="shapes_all",
            # 5 points: about the 95 % Wilson half-width of one evaluation's rate over its prompts
            margin="0.05",
            covers="the seed and the images' sampling noise; not the prompts: every run draws the same ones",
        ),
        Metric(
            "clean",
            "the share of drawn pixels in well-formed objects",
            "fraction of drawn pixels",
            "higher",
            pareto_against="shapes/all",
        ),
    ],
)
def shapes_evaluator(images: np.ndarray, ctx: SamplesContext) -> dict[str, float]:
    """eval.metrics=[shapes]: the images parsed and scored against their captions' scene specs."""
    return accuracy(images, ctx.specs)
