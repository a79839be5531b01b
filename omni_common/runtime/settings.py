"""Settings declared once. A config dataclass's field made with `setting(...)` carries its
default and its help text; its flag (`--max-batch`) and its environment variable
(`OMNISTAGE_MAX_BATCH`, which docker-compose.yml and deploy/k8s set) derive from the field's
name unless the declaration names them. `add_flags` makes a config class's flags, and
`values_from` reads the parsed flags back into its fields, as vLLM's EngineArgs derives its
flags from its config dataclasses."""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

ENV_PREFIX = "OMNISTAGE_"
# What a switch's environment variable reads as on (anything else: off).
TRUE = ("1", "true", "yes")
# The flag's type by the field's annotation; any other field reads text unless `parse` says.
FLAG_TYPES: dict[str, Callable[[str], Any]] = {"int": int, "float": float}
T = TypeVar("T")


@dataclass(frozen=True)
class Setting:
    """One setting, as `settings(cls)` reads it from its field's declaration."""

    help: str
    flag: str = ""
    env: str = ""  # without ENV_PREFIX
    choices: tuple[str, ...] = ()
    # The flag's text to the field's value, where the field holds more than a str, int or float.
    parse: Callable[[str], Any] | None = None
    # The flag's default by service (the field's default holds where the service is absent).
    by_service: Mapping[str, Any] | None = None
    # Filled in by `settings(cls)`:
    field: str = ""
    kind: str = ""  # the field's annotation
    default: Any = None

    @property
    def variable(self) -> str:
        return ENV_PREFIX + self.env


def setting(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    flag: str = "",
    env: str = "",
    choices: tuple[str, ...] = (),
    parse: Callable[[str], Any] | None = None,
    by_service: Mapping[str, Any] | None = None,
) -> Any:
    """A dataclass field that is also a flag with an environment fallback (no default: the
    field is required, and its flag reads empty unless given)."""
    declared = Setting(help=help, flag=flag, env=env, choices=choices, parse=parse, by_service=by_service)
    return dataclasses.field(default=default, metadata={"setting": declared})


def settings(cls: type) -> Iterator[Setting]:
    """The settings of a config dataclass, in field order, with their names filled in."""
    for field in dataclasses.fields(cls):
        declared = field.metadata.get("setting")
        if declared is None:
            continue  # a field that no flag sets (a replica's stage, the coordinator's replicas)
        yield dataclasses.replace(
            declared,
            field=field.name,
            flag=declared.flag or "--" + field.name.replace("_", "-"),
            env=declared.env or field.name.upper(),
            kind=field.type if isinstance(field.type, str) else field.type.__name__,
            default=field.default,
        )


def add_flags(parser: argparse.ArgumentParser, cls: type, service: str = "") -> None:
    """One flag per setting of `cls`; its default is the environment variable where set,
    else the setting's default (for `service`, where it has one by service)."""
    for s in settings(cls):
        raw = os.environ.get(s.variable)
        text = f"{s.help} [{s.variable}]"
        if s.kind == "bool":
            on = s.default if raw is None else raw in TRUE
            parser.add_argument(s.flag, dest=s.field, action="store_true", default=on, help=text)
            continue
        default = s.by_service.get(service, s.default) if s.by_service else s.default
        if default is dataclasses.MISSING or default == ():
            default = ""  # a required field, or a list empty by default: no text
        parser.add_argument(
            s.flag,
            dest=s.field,
            type=FLAG_TYPES.get(s.kind, str),
            # argparse converts a text default (the variable's) as it converts the flag's text.
            default=default if raw is None else raw,
            choices=s.choices or None,
            help=text,
        )


def values_from(cls: type[T], args: argparse.Namespace, **given: Any) -> T:
    """An instance of `cls` from the flags `add_flags` made: each setting's parsed value,
    unless `given` holds it (a field the caller reads from several flags, or checks first)."""
    values = dict(given)
    for s in settings(cls):
        if s.field not in given:
            value = getattr(args, s.field)
            values[s.field] = s.parse(value) if s.parse is not None and isinstance(value, str) else value
    return cls(**values)
