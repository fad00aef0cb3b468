"""Prompt lists for grids: DrawBench, PartiPrompts (copies and sources in prompts/SOURCES.md) and
ShapesBench, compositional prompts in the built-in data's own caption language, each with the
scene spec the shapes parser scores against."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from dalle_ablate.data.scenes import REL_PHRASE, Obj, Scene, _np, position_name
from dalle_ablate.registry import Registry

PROMPTS_DIR = Path(__file__).parent / "prompts"
PROMPT_LISTS: Registry = Registry("prompt list", "eval.grids")


@dataclass(frozen=True)
class Prompt:
    text: str
    category: str
    spec: Optional[dict] = None  # scene spec (ShapesBench only)


@PROMPT_LISTS.register("drawbench")
def drawbench() -> list[Prompt]:
    """DrawBench (Saharia et al. 2022, arXiv 2205.11487): 200 prompts, 11 categories."""
    with open(PROMPTS_DIR / "drawbench.csv", newline="", encoding="utf-8") as f:
        return [Prompt(r["prompt"], r["category"]) for r in csv.DictReader(f)]


@PROMPT_LISTS.register("partiprompts")
def partiprompts() -> list[Prompt]:
    """PartiPrompts (Yu et al. 2022, arXiv 2206.10789): 1632 prompts, 12 categories."""
    with open(PROMPTS_DIR / "partiprompts.tsv", newline="", encoding="utf-8") as f:
        return [Prompt(r["Prompt"], r["Category"]) for r in csv.DictReader(f, delimiter="\t")]


def _scene(objs: list[Obj], caption: str, relation: Optional[dict] = None) -> dict:
    return Scene(objs, caption, relation).to_dict()


@PROMPT_LISTS.register("shapesbench")
def shapesbench() -> list[Prompt]:
    """Compositional prompts for the shapes data, by category: colour, shape, size, position,
    count (lists of one to three objects), binding (two objects whose colours and shapes must
    not be swapped) and relation. Fixed, not drawn: the same prompts in every run."""
    return [*_one_object_prompts(), *_count_prompts(), *_binding_prompts(), *_relation_prompts()]


def _one(category: str, o: Obj, caption: str) -> Prompt:
    return Prompt(caption, category, _scene([o], caption))


def _one_object_prompts() -> list[Prompt]:
    """One object a prompt, six prompts a category: its colour, its shape, its size (small or large),
    its position in the 3 x 3 grid."""
    out = []
    for color, shape in [
        ("red", "circle"),
        ("blue", "square"),
        ("green", "triangle"),
        ("yellow", "square"),
        ("purple", "circle"),
        ("orange", "triangle"),
    ]:
        o = Obj(shape, color, "large", 1, 1, ["shape", "color"])
        out.append(_one("color", o, f"{_np(Obj(shape, color, 'large', 1, 1), False)} on a white background"))
    for shape, color in [
        ("circle", "blue"),
        ("square", "red"),
        ("triangle", "yellow"),
        ("circle", "green"),
        ("square", "orange"),
        ("triangle", "purple"),
    ]:
        o = Obj(shape, color, "large", 1, 1, ["shape", "color"])
        out.append(_one("shape", o, f"there is {_np(Obj(shape, color, 'large', 1, 1), True)}"))
    for size, shape, color in [
        ("small", "circle", "red"),
        ("large", "circle", "red"),
        ("small", "square", "blue"),
        ("large", "square", "blue"),
        ("small", "triangle", "green"),
        ("large", "triangle", "green"),
    ]:
        o = Obj(shape, color, size, 1, 1, ["shape", "color", "size"])
        out.append(_one("size", o, f"there is {_np(o, True)}"))
    for (row, col), shape, color in [
        ((0, 0), "circle", "red"),
        ((0, 2), "square", "blue"),
        ((2, 0), "triangle", "green"),
        ((2, 2), "circle", "yellow"),
        ((1, 1), "square", "purple"),
        ((0, 1), "triangle", "orange"),
    ]:
        o = Obj(shape, color, "large", row, col, ["shape", "color", "position"])
        out.append(_one("position", o, f"{_np(o, False)} at the {position_name(row, col)}"))
    return out


def _count_prompts() -> list[Prompt]:
    """Lists of one to three objects side by side in the middle row, named in order."""
    out = []
    for items in [
        [("red", "circle")],
        [("blue", "square"), ("yellow", "circle")],
        [("green", "triangle"), ("purple", "square")],
        [("red", "square"), ("green", "circle"), ("blue", "triangle")],
        [("orange", "circle"), ("blue", "circle"), ("red", "circle")],
        [("yellow", "triangle"), ("purple", "triangle")],
    ]:
        objs = [Obj(sh, c, "large", 1, i, ["shape", "color"]) for i, (c, sh) in enumerate(items)]
        parts = [_np(o, False) for o in objs]
        caption = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
        out.append(Prompt(caption, "count", _scene(objs, caption)))
    return out


def _binding_prompts() -> list[Prompt]:
    """Two objects in pairs that swap their colours (a red circle and a blue square, then a blue
    circle and a red square): a model that binds each colour to its own shape gets both right."""
    out = []
    for (c1, s1), (c2, s2) in [
        (("red", "circle"), ("blue", "square")),
        (("blue", "circle"), ("red", "square")),
        (("green", "triangle"), ("yellow", "circle")),
        (("yellow", "triangle"), ("green", "circle")),
        (("purple", "square"), ("orange", "triangle")),
        (("orange", "square"), ("purple", "triangle")),
    ]:
        objs = [Obj(s1, c1, "large", 1, 0, ["shape", "color"]), Obj(s2, c2, "large", 1, 2, ["shape", "color"])]
        caption = f"{_np(objs[0], False)} and {_np(objs[1], False)}"
        out.append(Prompt(caption, "binding", _scene(objs, caption)))
    return out


def _relation_prompts() -> list[Prompt]:
    """A red circle placed by a relation to a blue square: left of, right of, above and below in the
    middle row and column, then left of and above across a diagonal."""
    out = []
    for rel, (a_cell, b_cell) in [
        ("left of", ((1, 0), (1, 2))),
        ("right of", ((1, 2), (1, 0))),
        ("above", ((0, 1), (2, 1))),
        ("below", ((2, 1), (0, 1))),
        ("left of", ((0, 0), (2, 2))),
        ("above", ((0, 2), (2, 0))),
    ]:
        a = Obj("circle", "red", "large", *a_cell, ["shape", "color"])
        b = Obj("square", "blue", "large", *b_cell, ["shape", "color"])
        caption = f"{_np(a, False)} {REL_PHRASE[rel]} {_np(b, False)}"
        out.append(Prompt(caption, "relation", _scene([a, b], caption, {"subject": 0, "object": 1, "rel": rel})))
    return out


def by_category(prompts: list[Prompt], limit: Optional[int]) -> dict[str, list[Prompt]]:
    """Categories in first-seen order, each cut to its first `limit` prompts (None = all)."""
    out: dict[str, list[Prompt]] = {}
    for p in prompts:
        out.setdefault(p.category, []).append(p)
    return {c: ps[:limit] if limit else ps for c, ps in out.items()}


def slug(category: str) -> str:
    """A category as it appears in media keys and file names (`grids/<list>/<slug>/s<scale>`)."""
    return "".join(c if c.isalnum() else "_" for c in category.lower()).strip("_")
