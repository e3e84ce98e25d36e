"""Parse a container command the way it will run: torchrun's own parser, then meshserve's parsers.

A command that is not a ``meshserve`` entry point (or that meshserve's argparse rejects) raises.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services import cli
from services.controlplane import server as frontdoor
from services.local import launch

# Delegated subcommands parse their own arguments; the rest parse with the top-level parser.
_DELEGATED_PARSERS: dict[str, Callable[[], argparse.ArgumentParser]] = {
    "serve": launch.serve_parser,
    "health": launch.health_parser,
    "frontdoor": frontdoor.parser,
}


class NotAnEntryPoint(AssertionError):
    pass


@dataclass(frozen=True)
class Command:
    """A parsed container command: the meshserve subcommand, its arguments and any torchrun launcher."""

    subcommand: str
    args: argparse.Namespace
    torchrun: argparse.Namespace | None = None

    @property
    def module(self) -> str:
        """The service module a ``meshserve serve`` command runs."""
        if self.subcommand != "serve":
            raise NotAnEntryPoint(f"`meshserve {self.subcommand}` does not run a service module")
        return launch.module_of(self.args.service)


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    try:
        return parser.parse_args(list(argv))
    except SystemExit as exc:
        raise NotAnEntryPoint(f"meshserve rejects the arguments {list(argv)!r}") from exc


def parse(argv: Sequence[str]) -> Command:
    """Parse ``argv`` (``meshserve ...`` or ``torchrun ... --no-python meshserve ...``)."""
    argv = [str(a) for a in argv]
    if argv and argv[0] == "torchrun":
        import torch.distributed.run as torchrun

        launcher = _parse(torchrun.get_args_parser(), argv[1:])
        if not launcher.no_python:
            raise NotAnEntryPoint("torchrun must run the meshserve entry point with --no-python")
        inner = parse([launcher.training_script, *launcher.training_script_args])
        return Command(inner.subcommand, inner.args, launcher)
    if not argv or argv[0] != "meshserve":
        raise NotAnEntryPoint(f"{argv!r} is not a meshserve command")
    if len(argv) < 2:
        raise NotAnEntryPoint("meshserve needs a subcommand")
    sub = argv[1]
    if sub in ("-h", "--help") and len(argv) == 2:
        return Command("help", argparse.Namespace())
    if sub in cli._DELEGATED:
        if sub not in _DELEGATED_PARSERS:
            raise NotAnEntryPoint(f"no parser known for the delegated subcommand {sub!r}; add it to this table")
        return Command(sub, _parse(_DELEGATED_PARSERS[sub](), argv[2:]))
    return Command(sub, _parse(cli._parser(), argv[1:]))
