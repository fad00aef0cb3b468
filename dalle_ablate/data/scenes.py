"""Procedural scenes of coloured shapes: the spec, its caption and its anti-aliased rendering.

A scene is 1-3 objects, each a shape, a palette colour and a size, placed in distinct cells of a
3x3 grid. The caption is drawn from varied templates; the scene spec is kept with every example
(as JSON) and records which attributes the caption states, so that evaluation can check a
generated image against exactly what its caption asked for.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
from PIL import Image, ImageDraw

SHAPES = ("circle", "square", "triangle")
PALETTE = {  # name -> RGB; far apart so a palette snap is unambiguous
    "red": (230, 25, 45),
    "green": (40, 170, 60),
    "blue": (20, 90, 220),
    "yellow": (250, 210, 20),
    "purple": (140, 40, 170),
    "orange": (245, 125, 30),
}
BACKGROUND = (255, 255, 255)
SIZES = {"small": 0.22, "large": 0.36}  # half-extent as a fraction of a grid cell's width
ROWS = ("top", "middle", "bottom")
COLS = ("left", "center", "right")
SUPERSAMPLE = 4  # draw at 4x and box-filter down: anti-aliased edges


def position_name(row: int, col: int) -> str:
    if row == 1 and col == 1:
        return "center"
    if row == 1:
        return COLS[col]
    if col == 1:
        return ROWS[row]
    return f"{ROWS[row]} {COLS[col]}"


@dataclass
class Obj:
    shape: str
    color: str
    size: str
    row: int
    col: int
    said: list[str] = field(default_factory=list)  # attributes the caption states


@dataclass
class Scene:
    objects: list[Obj]
    caption: str
    relation: dict | None = None  # {"subject": i, "object": j, "rel": "left of"}

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, spec: dict) -> "Scene":
        return cls([Obj(**o) for o in spec["objects"]], spec["caption"], spec.get("relation"))


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _np(o: Obj, with_size: bool) -> str:
    words = ([o.size] if with_size else []) + [o.color, o.shape]
    return f"{_article(words[0])} {' '.join(words)}"


def _relation(a: Obj, b: Obj, rng: np.random.Generator) -> str:
    """A spatial relation of a to b that is true of their cells."""
    options = []
    if a.col < b.col:
        options.append("left of")
    if a.col > b.col:
        options.append("right of")
    if a.row < b.row:
        options.append("above")
    if a.row > b.row:
        options.append("below")
    return options[rng.integers(len(options))]


REL_PHRASE = {"left of": "to the left of", "right of": "to the right of", "above": "above", "below": "below"}


def _caption_one(o: Obj, rng: np.random.Generator) -> str:
    pos = position_name(o.row, o.col)
    t = rng.integers(5)
    if t == 0:
        o.said = ["shape", "color", "size", "position"]
        return f"{_np(o, True)} in the {pos}"
    if t == 1:
        o.said = ["shape", "color", "position"]
        return f"{_np(o, False)} at the {pos}"
    if t == 2:
        o.said = ["shape", "color", "size"]
        return f"there is {_np(o, True)}"
    if t == 3:
        o.said = ["shape", "color"]
        return f"{_np(o, False)} on a white background"
    o.said = ["shape", "color", "size", "position"]
    return f"{_article(o.size)} {o.size} {o.shape} in {o.color}, {pos}"


def _caption_many(objs: list[Obj], rng: np.random.Generator, relation: bool | None = None) -> tuple[str, dict | None]:
    """A list of the objects or, for two and `relation` (None: drawn, 60% yes), one relation."""
    # Half the captions of several objects state their sizes: with sizes said only of single
    # objects (a fifth of the data), size was the attribute the quickstart model learned last.
    sized = bool(rng.random() < 0.5)
    if relation is None:
        relation = len(objs) == 2 and bool(rng.random() < 0.6)
    if len(objs) == 2 and relation:
        a, b = objs
        rel = _relation(a, b, rng)
        for o in objs:
            o.said = ["shape", "color"] + (["size"] if sized else [])
        if rng.random() < 0.5:
            return f"{_np(a, sized)} {REL_PHRASE[rel]} {_np(b, sized)}", {"subject": 0, "object": 1, "rel": rel}
        return f"{_np(a, sized)} is {REL_PHRASE[rel]} {_np(b, sized)}", {"subject": 0, "object": 1, "rel": rel}
    with_pos = rng.random() < 0.5
    parts = []
    for o in objs:
        o.said = ["shape", "color"] + (["size"] if sized else []) + (["position"] if with_pos else [])
        parts.append(_np(o, sized) + (f" in the {position_name(o.row, o.col)}" if with_pos else ""))
    return ", ".join(parts[:-1]) + " and " + parts[-1], None


# Scene mixes (data.mix): how a scene's object count, and for two objects list or relation, is drawn.
MIXES = ("tiers", "counts")


def random_scene(rng: np.random.Generator, min_objects: int = 1, max_objects: int = 3, mix: str = "counts") -> Scene:
    """`mix="counts"`: the object count uniform in [min, max], two objects in a relation 60% of
    the time. `mix="tiers"`: each evaluation tier (`TIERS`) the range allows equally often; with
    1-3 objects that is a quarter each, where "counts" gives a list of two 13% of the scenes."""
    relation = None
    if mix == "tiers":
        allowed = [t for t in TIERS if min_objects <= TIER_OBJECTS[t] <= max_objects]
        name = allowed[int(rng.integers(len(allowed)))]
        n, relation = TIER_OBJECTS[name], name == "relation"
    else:
        n = int(rng.integers(min_objects, max_objects + 1))
    cells = rng.choice(9, size=n, replace=False)
    objs = [
        Obj(
            shape=SHAPES[rng.integers(len(SHAPES))],
            color=list(PALETTE)[rng.integers(len(PALETTE))],
            size=list(SIZES)[rng.integers(len(SIZES))],
            row=int(c) // 3,
            col=int(c) % 3,
        )
        for c in cells
    ]
    if n == 1:
        return Scene(objs, _caption_one(objs[0], rng))
    caption, rel = _caption_many(objs, rng, relation)
    return Scene(objs, caption, rel)


# Difficulty tiers of a caption, as the evaluation reports them, and their objects.
TIERS = ("one", "two", "three", "relation")
TIER_OBJECTS = {"one": 1, "two": 2, "three": 3, "relation": 2}


def tier(spec: dict) -> str:
    """One object; two or three objects listed; two objects in a stated relation."""
    if spec.get("relation") is not None:
        return "relation"
    return TIERS[len(spec["objects"]) - 1]


def shape_polygon(shape: str, cx: float, cy: float, r: float) -> list[tuple[float, float]] | None:
    """Outline used to draw a shape of half-extent r centred at (cx, cy); None for a circle."""
    if shape == "square":
        return [(cx - r, cy - r), (cx + r, cy - r), (cx + r, cy + r), (cx - r, cy + r)]
    if shape == "triangle":  # upright, its bounding box the same as the square's
        return [(cx, cy - r), (cx + r, cy + r), (cx - r, cy + r)]
    return None


def draw_shape(draw: ImageDraw.ImageDraw, shape: str, cx: float, cy: float, r: float, fill) -> None:
    poly = shape_polygon(shape, cx, cy, r)
    if poly is None:
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    else:
        draw.polygon(poly, fill=fill)


def render(scene: Scene, size: int = 64) -> np.ndarray:
    """The scene as an [size, size, 3] uint8 image, anti-aliased by 4x supersampling."""
    big = size * SUPERSAMPLE
    img = Image.new("RGB", (big, big), BACKGROUND)
    draw = ImageDraw.Draw(img)
    cell = big / 3
    for o in scene.objects:
        draw_shape(draw, o.shape, (o.col + 0.5) * cell, (o.row + 0.5) * cell, SIZES[o.size] * cell, PALETTE[o.color])
    return np.asarray(img.resize((size, size), Image.Resampling.BOX), dtype=np.uint8)


def shape_mask(shape: str, size_name: str, cx: float, cy: float, image_size: int) -> np.ndarray:
    """[image_size, image_size] bool: where one shape of that size, centred at pixel coordinates
    (cx, cy), covers at least half of a pixel when rendered as `render` does."""
    return shape_mask_r(shape, SIZES[size_name] * image_size / 3, cx, cy, image_size)


def shape_mask_r(shape: str, r: float, cx: float, cy: float, image_size: int) -> np.ndarray:
    """As `shape_mask`, for any half-extent r in pixels (the parser fits sizes between the data's)."""
    return shape_coverage(shape, r, cx, cy, image_size) >= 128


def shape_coverage(shape: str, r: float, cx: float, cy: float, image_size: int) -> np.ndarray:
    """[image_size, image_size] uint8: how much of each pixel (0-255) one shape of half-extent r
    (pixels) centred at (cx, cy) covers when rendered as `render` does."""
    big = image_size * SUPERSAMPLE
    img = Image.new("L", (big, big), 0)
    draw_shape(ImageDraw.Draw(img), shape, cx * SUPERSAMPLE, cy * SUPERSAMPLE, r * SUPERSAMPLE, 255)
    return np.asarray(img.resize((image_size, image_size), Image.Resampling.BOX))


DEMO_CAPTIONS = (
    "a large red circle in the center",
    "a blue square at the top left",
    "a small green triangle in the bottom right",
    "a yellow circle to the left of a purple square",
    "an orange triangle above a blue circle",
    "a red square, a green circle and a blue triangle",
)
