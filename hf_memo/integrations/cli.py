"""The ``hf-memo`` command line. Each subcommand lives in its own module with ``add_parser`` and ``run``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from hf_memo.integrations import demo, estimate, plan

SUBCOMMANDS = {"demo": demo, "estimate": estimate, "plan": plan}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-memo", description="Long-context training for Hugging Face Transformers.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in SUBCOMMANDS.items():
        module.add_parser(subparsers.add_parser(name, help=module.HELP, description=module.HELP))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; bad input exits with code 2 and a one-line reason, no traceback."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return SUBCOMMANDS[args.command].run(args) or 0
    except (ValueError, FileNotFoundError) as error:
        print(f"hf-memo {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
