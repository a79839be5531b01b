"""Each setting is declared once (runtime/settings.py): its field gives its flag, its
OMNISTAGE_* variable, its default and its help, so no command declares a flag or a variable
twice, every flag says what it is, and a setting two commands share is one declaration."""

from __future__ import annotations

import argparse
import inspect
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from omni_common.runtime.config import (
    CoordinatorConfig,
    GatewayConfig,
    StageConfig,
    add_coordinator_args,
    add_gateway_args,
    add_stage_args,
    coordinator_config,
    gateway_config,
    stage_config,
)
from omni_common.runtime.settings import add_flags, setting, settings
from omni_common.stages import STAGES

COMMANDS: dict[str, tuple[type, Callable[[argparse.ArgumentParser], None]]] = {
    **{stage: (StageConfig, lambda parser, stage=stage: add_stage_args(parser, stage)) for stage in STAGES},
    "coordinator": (CoordinatorConfig, add_coordinator_args),
    "gateway": (GatewayConfig, add_gateway_args),
}
VARIABLE = re.compile(r"\[(OMNISTAGE_[A-Z0-9_]+)\]$")


def flags_and_variables(parser: argparse.ArgumentParser) -> tuple[list[str], list[str]]:
    """The flags of a parser, and the variables their help texts name."""
    actions = [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]
    flags = [flag for action in actions for flag in action.option_strings]
    variables = [m.group(1) for a in actions if (m := VARIABLE.search(a.help or ""))]
    return flags, variables


def twice(names: list[str]) -> list[str]:
    return sorted(name for name, count in Counter(names).items() if count > 1)


@pytest.mark.parametrize("command", COMMANDS)
def test_no_command_declares_a_flag_or_a_variable_twice(command: str) -> None:
    _, add = COMMANDS[command]
    parser = argparse.ArgumentParser()
    add(parser)
    flags, variables = flags_and_variables(parser)
    assert not twice(flags) and not twice(variables), (twice(flags), twice(variables))
    # Every flag names the variable it falls back to.
    assert len(variables) == len(flags)


def test_the_check_sees_a_variable_declared_twice() -> None:
    @dataclass(frozen=True, kw_only=True)
    class Twice:
        lease_s: float = setting(1.0, "one", env="LEASE")
        lease_ttl_s: float = setting(2.0, "two", env="LEASE")

    parser = argparse.ArgumentParser()
    add_flags(parser, Twice)
    assert twice(flags_and_variables(parser)[1]) == ["OMNISTAGE_LEASE"]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_setting_has_help(command: str) -> None:
    config, _ = COMMANDS[command]
    assert not [s.flag for s in settings(config) if not s.help.strip()]


def declared_by(config: type, field: str) -> type:
    """The class whose body declares `field` (a base's, for an inherited one)."""
    return next(c for c in config.__mro__ if field in inspect.get_annotations(c))


def test_a_setting_that_commands_share_is_declared_once() -> None:
    by_flag: dict[str, set[type]] = {}
    for config, _ in COMMANDS.values():
        for s in settings(config):
            by_flag.setdefault(s.flag, set()).add(declared_by(config, s.field))
    # The gateway's --coordinator is where it sends requests; a stage's, where it registers
    # (empty by default): two settings of one name in two commands.
    by_flag["--coordinator"] -= {GatewayConfig}
    assert {flag: owners for flag, owners in by_flag.items() if len(owners) > 1} == {}
    # host and port are every service's; shm_dir and the rest the gRPC services'.
    assert declared_by(GatewayConfig, "port") is declared_by(StageConfig, "port")
    assert declared_by(CoordinatorConfig, "offload") is declared_by(StageConfig, "offload")


def test_a_variable_is_the_flags_default_and_the_flag_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNISTAGE_LEASE_TTL_S", "5")  # a flag (--lease-ttl) not named as its field
    monkeypatch.setenv("OMNISTAGE_CACHE_BYPASS", "yes")
    monkeypatch.setenv("OMNISTAGE_ROLES", "prior, ")
    monkeypatch.setenv("OMNISTAGE_MODEL", "/models/x")
    parser = argparse.ArgumentParser()
    add_stage_args(parser, "ar-encoder")
    config = stage_config("ar-encoder", parser.parse_args(["--max-batch", "3"]))
    assert (config.lease_ttl_s, config.cache_bypass, config.roles) == (5.0, True, ("prior",))
    assert (config.max_batch, config.port, str(config.model_dir)) == (3, 50061, "/models/x")
    config = stage_config("ar-encoder", parser.parse_args(["--lease-ttl", "7", "--roles", ""]))
    assert (config.lease_ttl_s, config.roles) == (7.0, ())


def test_each_service_listens_on_its_own_port_by_default() -> None:
    ports = {}
    for command, (_, add) in COMMANDS.items():
        parser = argparse.ArgumentParser()
        add(parser)
        args = parser.parse_args(["--model", "/m"] if command in STAGES else [])
        if command in STAGES:
            ports[command] = stage_config(command, args).port
        else:
            ports[command] = (coordinator_config if command == "coordinator" else gateway_config)(args).port
    assert ports == {
        "ar-encoder": 50061,
        "dit-denoise": 50062,
        "vae-decode": 50063,
        "coordinator": 50051,
        "gateway": 8000,
    }


@pytest.mark.parametrize("linger", ["-1", "31", "nan"])
def test_a_drain_linger_outside_the_drain_is_refused(linger: str) -> None:
    parser = argparse.ArgumentParser()
    add_stage_args(parser, "ar-encoder")
    with pytest.raises(SystemExit, match="--drain-linger-s must be 0"):
        stage_config("ar-encoder", parser.parse_args(["--model", "/m", "--drain-linger-s", linger]))
    config = stage_config("ar-encoder", parser.parse_args(["--model", "/m", "--drain-linger-s", "10"]))
    assert config.drain_linger_s == 10.0
