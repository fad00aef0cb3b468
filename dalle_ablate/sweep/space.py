"""Search spaces from Hydra overrides: `interval(a, b)`, `tag(log, interval(a, b))`,
`tag(int, interval(a, b))`, `choice(x, y)` or `x,y`, `range(a, b[, step])`, from the command line
or a sweep config's `params:` block -> optuna distributions. Every other override passes to the
jobs unchanged."""

from __future__ import annotations

from dataclasses import dataclass, field

import optuna.distributions as D
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, Override, RangeSweep

from dalle_ablate.registry import ConfigError


@dataclass
class Space:
    """name -> distribution; for categorical parameters name -> the override string of each choice."""

    distributions: dict[str, D.BaseDistribution]
    encoded: dict[str, dict]  # categorical: choice value -> override text
    fixed: list[str]  # overrides that are not searched
    keys: dict[str, str] = field(default_factory=dict)  # parameter name -> the override's key as written (`+new.field`)

    def overrides(self, params: dict) -> list[str]:
        """The job's overrides for a trial's parameter values."""
        out = list(self.fixed)
        for name, value in params.items():
            text = self.encoded[name][value] if name in self.encoded else _encode(value)
            out.append(f"{self.keys.get(name, name)}={text}")
        return out

    def grid(self) -> dict[str, list]:
        """The search space as value lists, for the grid sampler (discrete parameters only)."""
        out = {}
        for name, d in self.distributions.items():
            if isinstance(d, D.CategoricalDistribution):
                out[name] = list(d.choices)
            elif isinstance(d, D.IntDistribution) and not d.log:
                out[name] = list(range(d.low, d.high + 1, d.step))
            else:
                raise ConfigError(
                    f"hydra.sweeper.sampler.name=grid needs discrete parameters; {name} is {_describe(d)} "
                    "(use choice(...) or range(...), or another sampler: tpe, random, cmaes, nsgaii)"
                )
        return out


def _encode(value) -> str:
    return repr(value) if isinstance(value, float) else str(value)


def _describe(d: D.BaseDistribution) -> str:
    if isinstance(d, (D.FloatDistribution, D.IntDistribution)):
        return f"an interval [{d.low}, {d.high}]" + (" (log)" if d.log else "")
    return type(d).__name__


def distribution(override: Override) -> tuple[D.BaseDistribution, dict | None]:
    """(distribution, encoding of categorical choices or None) of one sweep override."""
    key = override.get_key_element()
    value = override.value()
    tags = set(getattr(value, "tags", set()) or set())
    unknown = tags - {"log", "int"}
    if unknown:
        raise ConfigError(f"{key}: unknown tag {', '.join(sorted(unknown))}; valid tags: log, int")
    if isinstance(value, IntervalSweep):
        low, high = value.start, value.end
        if not low < high:
            raise ConfigError(f"{key}: interval({low}, {high}) is empty; the lower bound must be below the upper")
        if "log" in tags and low <= 0:
            raise ConfigError(f"{key}: tag(log, interval({low}, {high})) needs a positive lower bound")
        if "int" in tags or (isinstance(low, int) and isinstance(high, int) and not isinstance(low, bool)):
            return D.IntDistribution(int(low), int(high), log="log" in tags), None
        return D.FloatDistribution(float(low), float(high), log="log" in tags), None
    if isinstance(value, RangeSweep):
        values = list(override.sweep_iterator())
        if not values:
            raise ConfigError(f"{key}: range({value.start}, {value.stop}, {value.step}) is empty")
        if all(isinstance(v, int) for v in values) and "log" not in tags:
            step = int(value.step)
            return D.IntDistribution(values[0], values[-1], step=step), None
        return _categorical(key, values, list(override.sweep_string_iterator()))
    if isinstance(value, ChoiceSweep):
        if "log" in tags:
            raise ConfigError(f"{key}: tag(log, ...) applies to interval(...) and range(...), not to choice(...)")
        return _categorical(key, list(override.sweep_iterator()), list(override.sweep_string_iterator()))
    raise ConfigError(
        f"{key}: {override.input_line} is not a search space; use interval, tag(log, interval), choice or range"
    )


def _categorical(key: str, values: list, texts: list[str]):
    # Optuna's categorical choices must be None, bool, int, float or str; anything else (a list,
    # a dict) is searched by its override text.
    primitive = all(v is None or isinstance(v, (bool, int, float, str)) for v in values)
    choices = values if primitive else texts
    if len(set(map(repr, choices))) != len(choices):
        raise ConfigError(f"{key}: choice has repeated values {texts}")
    return D.CategoricalDistribution(choices), dict(zip(choices, texts))


def parse(arguments: list[str], params: dict | None = None) -> Space:
    """The search space of command-line overrides plus a `params:` block (name -> override value
    text, as `optim.lr: tag(log, interval(1e-4, 1e-2))`); the command line wins on a clash."""
    parser = OverridesParser.create()
    block = [f"{k}={v}" for k, v in (params or {}).items()]
    try:
        parsed = parser.parse_overrides(block) + parser.parse_overrides(list(arguments))
    except Exception as e:  # noqa: BLE001 - Hydra's parse errors carry the offending text
        raise ConfigError(f"cannot parse sweep override: {str(e).splitlines()[0]}") from e
    dists, encoded, fixed, keys = {}, {}, {}, {}
    for o in parsed:  # by the name without its +/~ prefix: a later override of a name replaces an earlier one
        key = o.get_key_element()
        name = key.lstrip("+~")
        if o.is_sweep_override():
            d, enc = distribution(o)
            dists[name], keys[name] = d, key
            fixed.pop(name, None)
            if enc is not None:
                encoded[name] = enc
            else:
                encoded.pop(name, None)
        else:
            fixed[name] = o.input_line
            dists.pop(name, None)
    return Space(dists, encoded, list(fixed.values()), keys)
