"""Typed configuration: frozen dataclasses filled from a file, `--set` overrides and environment.

Precedence, lowest first: dataclass defaults, a preset (`base`, e.g. an algorithm preset), the
TOML/YAML file, `MILES_*` environment variables
(`MILES_BUS`, `MILES_LEARNER__LR`: `__` separates levels), then `--set a.b=c` overrides. Keys
unknown to the dataclass are errors in files and overrides; environment variables that name no
field are ignored, since other tools share the `MILES_` prefix. Strings (from any layer) are
parsed into the field's type; other values must already have it (ints are accepted for floats).
A nested section given in part keeps the other fields of its default (a `DemoConfig` whose
default learner has lr 1e-3 keeps it when only `learner.seed` is set).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tomllib
import types
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

from miles.errors import ConfigError

log = logging.getLogger(__name__)
T = TypeVar("T")
ENV_PREFIX = "MILES_"
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def choose(table: Mapping[str, T], name: str, what: str) -> T:
    """`table[name]`, or a ConfigError naming `what` and the valid choices."""
    if name not in table:
        raise ConfigError(f"unknown {what} {name!r}; valid choices: {', '.join(sorted(table))}")
    return table[name]


def load_config(cls: type[T], *, path: str | Path | None = None, overrides: Iterable[str] = (),
                env: Mapping[str, str] | None = None, base: Mapping[str, Any] | None = None
                ) -> T:
    return build(cls, merge(base or {}, read_layers(cls, path=path, overrides=overrides, env=env)))


def write_settings(settings: Any, path: Path) -> Path:
    """`settings` (a dataclass) as a YAML file that `load_config` reads back: how a process
    hands its children their settings."""
    import yaml

    plain = json.loads(json.dumps(dataclasses.asdict(settings), default=str))
    path.write_text(yaml.safe_dump(plain, sort_keys=False))
    return path


def read_layers(cls: type, *, path: str | Path | None = None, overrides: Iterable[str] = (),
                env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The file, environment and `--set` layers merged, unconverted (what `load_config` builds
    over its base)."""
    data = _read_file(Path(path)) if path else {}
    env = os.environ if env is None else env
    for dotted, text in _env_settings(cls, env):
        _set_path(data, dotted, text)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        _set_path(data, key.strip(), text.strip())
    return data


def merge(lower: Mapping[str, Any], upper: Mapping[str, Any]) -> dict[str, Any]:
    """`upper` over `lower`, section by section (nested mappings merged, not replaced)."""
    out = dict(lower)
    for key, value in upper.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            value = merge(out[key], value)
        out[key] = value
    return out


def nest(dotted: str, value: Any) -> dict[str, Any]:
    """{"a": {"b": value}} for "a.b"."""
    for part in reversed(dotted.split(".")):
        value = {part: value}
    return value


def _read_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    text = path.read_text()
    if path.suffix == ".toml":
        return tomllib.loads(text)
    if path.suffix in (".yaml", ".yml"):
        import yaml

        loaded = yaml.safe_load(text) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path} must hold a mapping at the top level")
        return loaded
    raise ConfigError(f"config file must be .toml, .yaml or .yml, got {path}")


def _env_settings(cls: type, env: Mapping[str, str]) -> list[tuple[str, str]]:
    known = set(field_paths(cls))
    found = []
    for name, text in env.items():
        if name.startswith(ENV_PREFIX):
            dotted = name[len(ENV_PREFIX):].lower().replace("__", ".")
            if dotted in known:
                found.append((dotted, text))
    return found


def field_paths(cls: type, prefix: str = "") -> list[str]:
    """Every settable dotted key of a config dataclass."""
    paths = []
    for name, tp in get_type_hints(cls).items():
        if name not in {f.name for f in dataclasses.fields(cls)}:
            continue
        nested = _dataclass_in(tp)
        paths.append(prefix + name)
        if nested is not None:
            paths.extend(field_paths(nested, f"{prefix}{name}."))
    return paths


def _set_path(data: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = data
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted}: {part} is not a section")
        node = child
    node[leaf] = value


def build(cls: type[T], data: Mapping[str, Any], where: str = "", default: Any = None) -> T:
    """A `cls` instance from a mapping, converting and checking every value; fields the mapping
    does not name come from `default` (an instance) if given, else from the dataclass."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where.rstrip('.') or 'config'} must be a mapping, got {data!r}")
    hints = get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"unknown config key {where}{unknown[0]}; known keys: "
                          f"{', '.join(sorted(names))}")
    values = {name: convert(hints[name], data[name], f"{where}{name}",
                            _field_default(cls, name, default))
              for name in names if name in data}
    try:
        return dataclasses.replace(default, **values) if default is not None else cls(**values)
    except TypeError as err:
        raise ConfigError(f"{where.rstrip('.') or cls.__name__}: {err}") from err
    except ConfigError as err:  # from __post_init__: "objective must ..." names its own field
        if not where:
            raise
        raise ConfigError(f"{where}{err}") from err


def _field_default(cls: type, name: str, instance: Any) -> Any:
    """The default value of field `name` (from `instance` when given), if it is a dataclass."""
    if instance is not None:
        value = getattr(instance, name)
    else:
        spec = next(f for f in dataclasses.fields(cls) if f.name == name)
        value = spec.default_factory() if spec.default_factory is not dataclasses.MISSING \
            else spec.default
    return value if dataclasses.is_dataclass(value) and not isinstance(value, type) else None


def _dataclass_in(tp: Any) -> type | None:
    if dataclasses.is_dataclass(tp):
        return tp
    if _is_union(tp):
        return next((a for a in get_args(tp) if dataclasses.is_dataclass(a)), None)
    return None


def _is_union(tp: Any) -> bool:
    return get_origin(tp) in (Union, types.UnionType)


def convert(tp: Any, value: Any, where: str, default: Any = None) -> Any:
    """`value` as type `tp`; strings (command line, environment) are parsed. `default`: the
    instance a partial section of a nested dataclass is merged into."""
    if _is_union(tp):
        args = get_args(tp)
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return convert(arg, value, where, default)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0] if errors else f"{where}: cannot be {value!r}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, str):
            value = _parse_json(value, where)
        if dataclasses.is_dataclass(value) and isinstance(value, tp):
            return value
        return build(tp, value, f"{where}.", default if isinstance(default, tp) else None)
    if get_origin(tp) is Literal:
        if value not in get_args(tp):
            raise ConfigError(f"{where} must be one of {list(get_args(tp))}, got {value!r}")
        return value
    if get_origin(tp) is tuple:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        item = get_args(tp)[0]
        return tuple(convert(item, v, f"{where}[{i}]") for i, v in enumerate(value))
    return _scalar(tp, value, where)


def _parse_json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{where}: expected JSON, got {text!r}") from err


def _scalar(tp: Any, value: Any, where: str) -> Any:
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is Path:
        if isinstance(value, (str, Path)):
            return Path(value)
    elif tp is Any:
        return value
    else:
        raise ConfigError(f"{where}: unsupported config type {tp!r}")
    raise ConfigError(f"{where} must be {getattr(tp, '__name__', tp)}, got {value!r}")


def describe(config: Any) -> str:
    """The resolved config as one JSON line, for the log at start-up."""
    return json.dumps(dataclasses.asdict(config), default=str, sort_keys=True)


def log_config(config: Any) -> None:
    log.info("config %s %s", type(config).__name__, describe(config))


def parse_config_args(cls: type[T], argv=None, *, prog: str, description: str,
                      presets: Mapping[str, Mapping[str, Any]] | None = None,
                      algo_at: str = "") -> T:
    """`--config FILE` and repeated `--set KEY=VALUE`, the command line of every daemon; with
    `presets` (algorithm presets for the `AlgorithmConfig` at dotted path `algo_at`), also
    `--algo PRESET`, and the chosen preset is the lowest layer (`load_with_preset`)."""
    import argparse

    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", type=Path, default=None, help="TOML or YAML file")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override one setting, e.g. --set learner.lr=1e-4")
    if presets is not None:
        parser.add_argument("--algo", default=None, help="algorithm preset (miles algorithms)")
    args = parser.parse_args(argv)
    if presets is None:
        return load_config(cls, path=args.config, overrides=args.set)
    return load_with_preset(cls, presets, algo_at, algo=args.algo, path=args.config,
                            overrides=args.set)


def load_with_preset(cls: type[T], presets: Mapping[str, Mapping[str, Any]], at: str, *,
                     algo: str | None = None, path: str | Path | None = None,
                     overrides: Iterable[str] = ()) -> T:
    """`load_config` over an algorithm preset: the one `algo` (`--algo`) names, or else the one
    the file, environment or `--set` name at `<at>.name`; both naming different presets is an
    error. `presets` maps each name to its fields. An unknown `<at>.name` is left for the
    config's own validation, which names the field."""
    if algo is not None:
        choose(presets, algo, "algorithm preset (--algo)")
    data = read_layers(cls, path=path, overrides=overrides)
    named = _section(data, at).get("name")
    if algo is not None and named is not None and named != algo:
        raise ConfigError(f"--algo {algo} and {at}.name={named!r} disagree; name one preset")
    name = algo or named
    base = nest(at, presets[name]) if name in presets else {}
    return build(cls, merge(base, data))


def _section(data: Mapping[str, Any], dotted: str) -> Mapping[str, Any]:
    for part in dotted.split("."):
        data = data.get(part, {}) if isinstance(data, Mapping) else {}
    return data if isinstance(data, Mapping) else {}
