"""Loading user code named by a `package.module:attribute` spec (reward functions, environments).

One helper so every plugin kind fails the same way: a `ConfigError` that names the setting, the
spec and what went wrong (the module cannot be imported, with the import-time error; or it has no
such attribute). What the attribute must be (callable, a subclass of something) is the caller's
check, since only the caller knows.
"""

from __future__ import annotations

import importlib

from miles.errors import ConfigError


def split_spec(spec: str) -> tuple[str, str] | None:
    """(module, attribute) of a `package.module:attribute` spec, or None if it is not one."""
    module_name, sep, attr = spec.partition(":")
    if not (sep and module_name and attr):
        return None
    return module_name, attr


def import_object(spec: str, *, kind: str) -> object:
    """The attribute a `module:attribute` spec names; ConfigError `{kind} {spec!r}: ...` if not.

    `kind` is the setting's name (`reward`, `env`) so the error says which setting was wrong.
    Any exception raised while importing the module (user code runs at import) is reported.
    """
    parts = split_spec(spec)
    if parts is None:
        raise ConfigError(f"{kind} {spec!r} is not of the form package.module:Name")
    module_name, attr = parts
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 - any import-time failure of user code
        raise ConfigError(f"{kind} {spec!r}: module {module_name!r} cannot be imported: "
                          f"{type(err).__name__}: {err}") from err
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"{kind} {spec!r}: module {module_name!r} has no attribute "
                          f"{attr!r}") from None
