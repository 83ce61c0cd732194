"""The ``hf-memo`` command line. Each subcommand lives in its own module with ``add_parser`` and ``run``.

Only the module of the command that runs is imported: the demo's brings in the Trainer and ``datasets``, which
``hf-memo estimate`` has no use for, and ``hf-memo --help`` / ``--version`` import neither PyTorch nor Transformers
(``import hf_memo`` is light, its public names load on first use). A mistyped command or flag is answered with
the closest one (``did you mean --gpu-memory?``).
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any

SUBCOMMANDS = {  # name -> (module, one-line help)
    "demo": (
        "hf_memo.integrations.demo",
        "Fine-tune a small Llama on the LongAlpaca sample on CPU with hf_memo and with plain Hugging Face; compare.",
    ),
    "estimate": (
        "hf_memo.integrations.estimate",
        "Estimate peak GPU and host memory of a training step per mode, and the longest sequence that fits.",
    ),
    "plan": (
        "hf_memo.integrations.plan",
        "Plan the memory of one training step (offline DSA, bi-level) and compare it with PyTorch's caching allocator.",
    ),
}


def did_you_mean(words: Sequence[str], choices: Sequence[str]) -> str:
    """``"; did you mean X?"`` naming the choice closest to each of ``words`` that has a close one, else ``""``.

    A flag given as ``--flag=value`` is matched by its name.
    """
    close = {}
    for word in words:
        match = difflib.get_close_matches(word.split("=", 1)[0], choices, n=1, cutoff=0.6)
        if match:
            close[word] = match[0]
    if len(close) == 1:
        return f"; did you mean {next(iter(close.values()))}?"
    return "; did you mean " + ", ".join(f"{match} for {word}" for word, match in close.items()) + "?" if close else ""


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that answers unrecognized flags with the closest flag of the command they were given to.

    ``commands`` maps each subcommand to its parser (filled by :func:`build_parser`).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.commands: dict[str, argparse.ArgumentParser] = {}

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        """Like ``ArgumentParser.parse_args``; an unrecognized flag is reported by its command's parser, with a
        suggestion from that command's flags."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            parser = self.commands.get(getattr(parsed, "command", None), self)
            known = [option for action in parser._actions for option in action.option_strings]
            flags = [arg for arg in extras if arg.startswith("-")]
            parser.error(f"unrecognized arguments: {' '.join(extras)}{did_you_mean(flags, known)}")
        return parsed


def installed_version() -> str:
    """The installed distribution's version (its metadata: the package root is not imported from below it)."""
    try:
        return version("hf-memo")
    except PackageNotFoundError:
        return "(not installed)"


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; ``command``'s arguments are added (its module imported) if it names a subcommand."""
    parser = Parser(prog="hf-memo", description="Long-context training for Hugging Face Transformers.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {installed_version()}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        subparser = subparsers.add_parser(name, help=help_text, description=help_text)
        parser.commands[name] = subparser
        if name == command:
            importlib.import_module(module).add_parser(subparser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; bad input exits with code 2 and a one-line reason, no traceback."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    parser = build_parser(command)
    if command is not None and command not in SUBCOMMANDS:
        choices = ", ".join(SUBCOMMANDS)
        parser.error(f"no command {command!r} (choose from {choices}){did_you_mean([command], list(SUBCOMMANDS))}")
    args = parser.parse_args(argv)
    try:
        return importlib.import_module(SUBCOMMANDS[args.command][0]).run(args) or 0
    except (ValueError, FileNotFoundError) as error:
        print(f"hf-memo {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
