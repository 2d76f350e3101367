"""Reading compose/*.yml as Docker Compose does, for the tests that have no Docker engine.

What is done here, by the Compose Specification's rules, for the parts of the format the stack
uses: YAML anchors and `<<` merge keys (PyYAML), interpolation (`${VAR}`, `${VAR:-default}`,
`${VAR-default}`, `${VAR:+alt}`, `${VAR+alt}`, `${VAR:?error}`, `$VAR`, `$$` for a literal `$`),
merging override files (mappings merged key by key; a service's `volumes` merged by container
path; other sequences, such as `command`, replaced; `!override` replaces, `!reset` removes), and
profiles (a service without `profiles`
is always on). Not done: `extends`, `include`, `env_file`, long-form volume syntax, a variable
in a default (`${A:-${B}}`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

COMPOSE_DIR = Path(__file__).resolve().parents[1] / "compose"
BASE = COMPOSE_DIR / "docker-compose.yml"
OVERRIDES = {"gpu": COMPOSE_DIR / "gpu.yml", "secure": COMPOSE_DIR / "secure.yml"}
_VARIABLE = re.compile(r"\$(?:(?P<escaped>\$)|\{(?P<braced>[^}]*)\}"
                       r"|(?P<named>[A-Za-z_][A-Za-z0-9_]*))")
_BRACED = re.compile(r"(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-+?])(?P<arg>.*))?$", re.S)


class InterpolationError(ValueError):
    pass


def interpolate(text: str, env: Mapping[str, str]) -> str:
    """`text` with its variables replaced from `env`, as Compose does."""
    def replace(match: re.Match) -> str:
        if match["escaped"]:
            return "$"
        if match["named"]:
            return env.get(match["named"], "")
        braced = _BRACED.match(match["braced"])
        if braced is None:
            raise InterpolationError(f"invalid interpolation {match[0]!r}")
        name, op, arg = braced["name"], braced["op"], braced["arg"] or ""
        value = env.get(name)
        unset = value is None or (op is not None and op.startswith(":") and value == "")
        arg = interpolate(arg, env) if op else arg
        if op is None:
            return value or ""
        if op.endswith("-"):
            return arg if unset else value
        if op.endswith("+"):
            return "" if unset else arg
        if unset:  # ?: a required variable
            raise InterpolationError(f"{name} is required: {arg}")
        return value
    return _VARIABLE.sub(replace, text)


def variables(node: Any) -> list[str]:
    """Every `${...}` expression (without the `$$`-escaped ones) in a loaded file."""
    found = []
    for text in _strings(node):
        found += [m["braced"] for m in _VARIABLE.finditer(text) if m["braced"] is not None]
    return found


def _strings(node: Any):
    if isinstance(node, str):
        yield node
    elif isinstance(node, Mapping):
        for key, value in node.items():
            yield from _strings(key)
            yield from _strings(value)
    elif isinstance(node, list):
        for item in node:
            yield from _strings(item)


def _interpolated(node: Any, env: Mapping[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, Mapping):
        return type(node)({key: _interpolated(value, env) for key, value in node.items()})
    if isinstance(node, list):
        return type(node)(_interpolated(item, env) for item in node)
    return node


class OverrideMap(dict):
    """`!override {...}`: replaces the value it is merged over."""


class OverrideList(list):
    """`!override [...]`."""


class Reset:
    """`!reset`: removes the value it is merged over."""


class _Loader(yaml.SafeLoader):
    pass


def _override(loader: yaml.SafeLoader, node: yaml.Node):
    if isinstance(node, yaml.MappingNode):
        return OverrideMap(loader.construct_mapping(node, deep=True))
    return OverrideList(loader.construct_sequence(node, deep=True))


_Loader.add_constructor("!override", _override)
_Loader.add_constructor("!reset", lambda loader, node: Reset())


def load_raw(path: Path) -> dict:
    return yaml.load(path.read_text(), Loader=_Loader)


def plain(node: Any) -> Any:
    """A loaded file as plain JSON values (for the schema): `!reset` keys dropped."""
    if isinstance(node, Mapping):
        return {k: plain(v) for k, v in node.items() if not isinstance(v, Reset)}
    if isinstance(node, list):
        return [plain(item) for item in node]
    return node


def load(*paths: Path, env: Mapping[str, str] | None = None) -> dict:
    """The project of `paths` (base first), interpolated with `env` and merged."""
    project: dict = {}
    for path in paths:
        project = merge(project, _interpolated(load_raw(path), env or {}))
    return plain(project)


def merge(base: Mapping, override: Mapping, where: str = "") -> dict:
    out = dict(base)
    for key, value in override.items():
        here = f"{where}.{key}" if where else str(key)
        if isinstance(value, Reset):
            out.pop(key, None)
        elif isinstance(value, (OverrideMap, OverrideList)):
            out[key] = dict(value) if isinstance(value, OverrideMap) else list(value)
        elif isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(out[key], value, here)
        elif key == "volumes" and where.startswith("services.") and key in out:
            out[key] = _merge_mounts(out[key], value)
        else:
            out[key] = value
    return out


def _merge_mounts(base: list[str], override: list[str]) -> list[str]:
    by_target = {mount_target(m): m for m in base}
    by_target.update({mount_target(m): m for m in override})
    return list(by_target.values())


def mount_target(mount: str) -> str:
    """The container path of a short-syntax volume `SOURCE:TARGET[:MODE]`."""
    parts = mount.split(":")
    return parts[1] if len(parts) > 1 else parts[0]


def mount_source(mount: str) -> str:
    return mount.split(":")[0]


def active_services(project: Mapping, profiles: set[str]) -> dict[str, dict]:
    """The services `up` starts with `--profile` for each of `profiles`."""
    return {name: service for name, service in project["services"].items()
            if not service.get("profiles") or set(service["profiles"]) & profiles}


def environment(service: Mapping) -> dict[str, str]:
    """A service's `environment`, mapping or list form, values as strings."""
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.partition("=")[::2] for item in env)
    return {key: "" if value is None else str(value) for key, value in env.items()}
