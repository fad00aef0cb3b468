"""Name-based registries (as in big_vision): one place to add a variant, and a failed lookup
that lists the valid names."""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A user mistake in a config value, data file or flag. Its message is shown as one line, and
    the process exits with code 2."""


class RunFailed(RuntimeError):
    """A run that ended without finishing, for a known reason (diverged, a checkpoint that could
    not be written, a tracker that cannot connect): one line on stderr and `exit_code`."""

    DIVERGED = 3
    FAILED = 4

    def __init__(self, message: str, exit_code: int = FAILED):
        super().__init__(message)
        self.exit_code = exit_code


def first_line(e: BaseException) -> str:
    """`Type: first line of the message`, for a one-line report of an exception."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


class Registry(Generic[T]):
    def __init__(self, kind: str, field: str):
        self.kind = kind  # e.g. "layout"
        self.field = field  # the config field users set, e.g. "model.layout"
        self._items: dict[str, T] = {}

    def register(self, name: str, item: T | None = None) -> Callable[[T], T] | T:
        def add(obj: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} registered twice")
            self._items[name] = obj
            return obj

        return add if item is None else add(item)

    def get(self, name: str) -> T:
        if name not in self._items:
            raise ConfigError(
                f"{self.field}={name!r} is not a known {self.kind}; valid: {', '.join(self.names())}"
            )
        return self._items[name]

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        return name in self._items
