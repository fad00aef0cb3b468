"""Each default in one place (issue 39): a YAML preset sets only what differs from the default of
the config dataclass it fills. A value a preset repeats would be a second home for that default:
change the dataclass and the preset silently keeps the old value."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml
from conftest import CONF, compose
from omegaconf import MISSING, DictConfig, OmegaConf

# What each group's preset fills: its own section (`<group>.*`), the model (`size`: `@package model`)
# or the whole run config (`@package _global_`: arms, experiments, sweeps; and conf/config.yaml).
SECTION = {"size": "model", "arm": "", "experiment": "", "sweeps": ""}

# Keys a preset sets to its dataclass's default on purpose, with the reason. Each must still be a
# repeat (test_the_listed_repeats_still_repeat), so the list does not outlive its reasons.
REPEATS_ON_PURPOSE = {
    ("arm/shampoo.yaml", "optim.lr"): "the best rate of the arm's grid (docs/shampoo.md), which the study page "
    "shows beside the arm (tests/report/test_page.py); it stays 1e-3 if Shampoo's default rate moves",
    (
        "experiment/study_ffn.yaml",
        "trainer.steps",
    ): "the experiment's budget, which stays if trainer.steps' default moves",
    (
        "experiment/study_layouts.yaml",
        "trainer.steps",
    ): "the experiment's budget, which stays if trainer.steps' default moves",
    ("experiment/optim_compare.yaml", "trainer.log_every"): "the logging interval the benchmark's wall times "
    "were measured with (logging costs time): it stays 50 if trainer.log_every's default moves",
}


def presets() -> list[tuple[str, Path]]:
    """(group, file) of every preset of every group, and ("", conf/config.yaml)."""
    groups = sorted(p.name for p in CONF.iterdir() if p.is_dir() and not p.name.startswith("_"))
    return [(g, f) for g in groups for f in sorted((CONF / g).glob("*.yaml"))] + [("", CONF / "config.yaml")]


def overrides(group: str, option: str) -> list[str]:
    """The overrides that choose the preset. A model preset is composed without a size preset (the
    size, applied after it, would mask what the layout sets); a size for the single-stream family
    with it."""
    if not group:
        return []
    if group == "arm":
        return [f"+arm={option}"]
    extra = {"model": ["~size"], "size": ["model=dalle"] if option == "dalle12b" else []}.get(group, [])
    return [f"{group}={option}", *extra]


def leaves(node, path: tuple = ()) -> list[tuple[str, ...]]:
    """Dotted paths of the values a preset sets: not its defaults list, not Hydra's own settings."""
    if not isinstance(node, dict):
        return [path]
    out = []
    for k, v in node.items():
        if not path and k in ("defaults", "hydra"):
            continue
        out += leaves(v, (*path, str(k)))
    return out


def default_of(klass: type, name: str):
    f = {f.name: f for f in dataclasses.fields(klass)}[name]
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else MISSING


def repeats(group: str, path: Path) -> dict[str, object]:
    """field -> what it is set to, for every field this preset sets to its dataclass's default."""
    return repeats_in(yaml.safe_load(path.read_text()) or {}, compose(*overrides(group, path.stem)), group, path.name)


def repeats_in(raw: dict, cfg: DictConfig, group: str, name: str) -> dict[str, object]:
    """The fields of the preset `raw` that `cfg` (the config composed with it) holds at the default
    of their dataclass: the class the composed config gives the field's section, so the default of
    the option chosen (an arm's `override /optim: shampoo`: ShampooConfig's)."""
    prefix = SECTION.get(group, group)
    section = OmegaConf.select(cfg, prefix) if prefix else cfg
    found = {}
    for leaf in leaves(raw):
        full = ".".join(filter(None, [prefix, *leaf]))
        parent = OmegaConf.select(section, ".".join(leaf[:-1])) if len(leaf) > 1 else section
        assert isinstance(parent, DictConfig), f"{name}: {full} is not in a config section"
        klass = OmegaConf.get_type(parent)
        assert dataclasses.is_dataclass(klass), f"{name}: {full} is in {klass}, not in a config dataclass"
        value = OmegaConf.to_container(parent, resolve=False)[leaf[-1]]  # an interpolation as written, ??? as ???
        default = default_of(klass, leaf[-1])
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and not isinstance(default, bool)
        if value == default and (number or type(value) is type(default)):
            found[".".join(leaf) if prefix else full] = value
    return found


@pytest.mark.parametrize("group,path", presets(), ids=[str(p.relative_to(CONF)) for _, p in presets()])
def test_a_preset_sets_only_what_differs_from_its_dataclass(group, path):
    name = str(path.relative_to(CONF))
    found = {k: v for k, v in repeats(group, path).items() if (name, k) not in REPEATS_ON_PURPOSE}
    assert not found, (
        f"{name} sets {', '.join(f'{k}={v!r}' for k, v in found.items())}: the default of its "
        f"dataclass already (delete the line, or list it in REPEATS_ON_PURPOSE with the reason)"
    )


def test_the_listed_repeats_still_repeat():
    for (name, key), _reason in REPEATS_ON_PURPOSE.items():
        group = name.split("/")[0]
        assert key in repeats(group, CONF / name), (
            f"{name}: {key} is no longer its default; drop it from REPEATS_ON_PURPOSE"
        )


def test_a_repeated_default_is_found():
    """The check itself: a field set to its dataclass's default is found, in a nested section too;
    one that differs is not; under an option a preset selects, the default is that option's."""
    optim = {"b1": 0.9, "b2": 0.95, "powersgd": {"rank": None, "exclude": ["embed"]}}
    cfg = compose("optim=adam", "optim.b1=0.9", "optim.b2=0.95", "optim.powersgd.exclude=[embed]")
    assert repeats_in(optim, cfg, "optim", "adam.yaml") == {"b1": 0.9, "powersgd.rank": None}
    arm = {"optim": {"lr": 1e-3}, "trainer": {"steps": 100}}
    shampoo = compose("optim=shampoo", "trainer.steps=100")
    assert repeats_in(arm, shampoo, "arm", "x.yaml") == {"optim.lr": 1e-3}
    adafactor = compose("optim=adafactor", "optim.lr=1e-3", "trainer.steps=100")  # its default is 1e-2
    assert repeats_in(arm, adafactor, "arm", "x.yaml") == {}


def test_the_reference_says_what_a_preset_sets_the_options_it_chooses_included():
    from dalle_ablate.docs import config_reference

    rows = [line for line in config_reference().splitlines() if line.startswith("| `")]
    sets = {}  # option -> the "what it sets" cells of its rows (arm/deepnet and model/deepnet: two)
    for row in rows:
        sets.setdefault(row.split(" | ")[0].strip("|` "), []).append(row.rsplit(" | ", 1)[-1].removesuffix(" |"))
    assert sets["linear"] == ["nothing: the defaults"]  # a preset that only starts from its schema
    assert "`model=deepnet`" in sets["deepnet"]  # the arm: the option it chooses
    assert sets["lr_adafactor"][0].startswith(
        "`optim=adafactor`, `schedule=constant`, `hydra/sweeper=optuna`, `trainer.steps=300`"
    )
