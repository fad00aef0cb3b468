"""Name-based registries (as in big_vision): one place to add a variant, and a failed lookup
that lists the valid names. An option of a config group (an optimizer, schedule, dataset, tracker
or model family) is registered once, by `Registry.option`, with its config dataclass: the builder
goes in the registry and the dataclass in Hydra's ConfigStore, where the group's YAML presets
start from it (`/schema/<group>_<name>@_here_`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Generic, TypeVar

from hydra.core.config_store import ConfigStore

T = TypeVar("T")


class ConfigError(ValueError):
    """A user mistake in a config value, data file or flag. Its message is shown as one line, and
    the process exits with code 2."""


class RunFailed(RuntimeError):
    """A run that ended without finishing, for a known reason (diverged, a checkpoint that could
    not be written, a tracker that cannot connect): one line on stderr and `exit_code`."""

    DIVERGED = 3
    FAILED = 4
    TIME_LIMIT = 5  # a study stopped at its --time-limit: what finished is kept, the same command continues

    def __init__(self, message: str, exit_code: int = FAILED):
        super().__init__(message)
        self.exit_code = exit_code


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, after the run saved a checkpoint of its last step and its summary: the message
    (how to resume) is shown as one line, and the process exits with code 130 (143 after a
    SIGTERM, interrupts.exit_code). A KeyboardInterrupt,
    so a multirun or a sweep stops at it, as at any Ctrl-C."""


def first_line(e: BaseException) -> str:
    """`Type: first line of the message`, for a one-line report of an exception."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


_ABSENT = object()


def check_ranges(section: Any, ranges: dict[str, str], prefix: str = "") -> None:
    """Raise ConfigError for the first field of `ranges` (dotted paths under `section`, each
    with an interval like "[0, 1)", "(0, inf)" or "[1, inf) or null") outside its interval, naming
    `prefix.path` and the interval. Fields the section does not have are skipped."""
    for path, spec in ranges.items():
        *parents, leaf = path.split(".")
        node = section
        for part in parents:
            node = getattr(node, part)
        value = getattr(node, leaf, _ABSENT)
        if value is _ABSENT:
            continue
        interval, optional = spec.removesuffix(" or null"), spec.endswith(" or null")
        if value is None and optional:
            continue
        lo, hi = (float(x) for x in interval[1:-1].split(","))
        ok = value is not None and (lo <= value if interval[0] == "[" else lo < value)
        ok = ok and (value <= hi if interval[-1] == "]" else value < hi)
        check(ok, f"{prefix + '.' if prefix else ''}{path}={value} must be in {spec}")


@dataclass
class OptionConfig:
    """Base of an option's config dataclass. `RANGES` (field -> interval, merged down the class
    hierarchy) and `validate` run when the run config is validated, before anything is built."""

    RANGES: ClassVar[dict[str, str]] = {}

    def validate(self, run: Any) -> None:
        """Checks beyond the ranges; `run` is the whole RunConfig, for checks that span groups."""

    def check_all(self, run: Any, prefix: str) -> None:
        """RANGES (merged down the class hierarchy, fields named `prefix.<field>`), then validate(run)."""
        ranges: dict[str, str] = {}
        for klass in reversed(type(self).__mro__):
            ranges.update(vars(klass).get("RANGES", {}))
        check_ranges(self, ranges, prefix)
        self.validate(run)


class Registry(Generic[T]):
    def __init__(self, kind: str, field: str, key: str = "name"):
        self.kind = kind  # e.g. "layout"
        self.field = field  # the config field users set, e.g. "model.layout"; for options, the group
        self.key = key  # options: the field of the group's config that names the option
        self._items: dict[str, T] = {}
        self._schemas: dict[str, type] = {}

    def register(self, name: str, item: T | None = None) -> Callable[[T], T] | T:
        def add(obj: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} registered twice")
            self._items[name] = obj
            return obj

        return add if item is None else add(item)

    def option(self, name: str, schema: type) -> Callable[[T], T]:
        """Decorator registering `builder` as option `name` of the config group `self.field`, with
        `schema` (an OptionConfig dataclass whose `key` field defaults to `name`) stored in Hydra's
        ConfigStore as `schema/<group>_<name>`."""
        default = getattr(schema, self.key, None)
        if default != name:
            raise ValueError(f"{schema.__name__}.{self.key} defaults to {default!r}, not to its option name {name!r}")

        def add(builder: T) -> T:
            self.register(name, builder)
            self._schemas[name] = schema
            ConfigStore.instance().store(group="schema", name=f"{self.field}_{name}", node=schema)
            return builder

        return add

    def validate(self, cfg: Any, run: Any) -> None:
        """The chosen option exists, `cfg` is its schema, its fields are in range and its own
        `validate(run)` passes."""
        name = getattr(cfg, self.key)
        self.get(name)
        schema = self._schemas[name]
        check(
            isinstance(cfg, schema),
            f"{self.field}.{self.key}={name!r} does not match the {self.field} preset chosen ({type(cfg).__name__}); "
            f"choose the option itself with {self.field}={name}",
        )
        cfg.check_all(run, self.field)

    def schema(self, name: str) -> type:
        """The config dataclass option `name` was registered with."""
        self.get(name)
        return self._schemas[name]

    def get(self, name: str) -> T:
        if name not in self._items:
            field = self.field if self.key == "name" else f"{self.field}.{self.key}"
            raise ConfigError(f"{field}={name!r} is not a known {self.kind}; valid: {', '.join(self.names())}")
        return self._items[name]

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        return name in self._items
