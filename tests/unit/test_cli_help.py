"""Every argument of every `omnistage` subcommand says what it is in `--help`."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

from omnistage_cli.main import build_parser


def arguments(parser: argparse.ArgumentParser, path: str) -> Iterator[tuple[str, argparse.Action]]:
    """(subcommand path, action) for every argument, through every level of subcommands."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from arguments(child, f"{path} {name}")
        elif not isinstance(action, argparse._HelpAction):
            yield path, action


def test_every_flag_and_argument_of_every_subcommand_has_help() -> None:
    found = list(arguments(build_parser(), "omnistage"))
    missing = [
        f"{path} {'/'.join(action.option_strings) or action.dest}"
        for path, action in found
        if not action.help or action.help == argparse.SUPPRESS
    ]
    assert not missing, f"arguments without help: {missing}"
    # The walk reaches the nested subcommands (serve's stages, lora's actions), not just the top.
    paths = {path for path, _ in found}
    assert {"omnistage serve dit-denoise", "omnistage lora add", "omnistage cluster up"} <= paths


def test_the_check_sees_an_argument_without_help() -> None:
    parser = argparse.ArgumentParser()
    parser.add_subparsers().add_parser("x").add_argument("--bare")
    assert [a.dest for _, a in arguments(parser, "p") if not a.help] == ["bare"]
