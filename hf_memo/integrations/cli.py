"""The ``hf-memo`` command line. Each subcommand lives in its own module with ``add_parser`` and ``run``.

Only the module of the command that runs is imported: the demo's brings in the Trainer and ``datasets``, which
``hf-memo estimate`` has no use for.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

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


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; ``command``'s arguments are added (its module imported) if it names a subcommand."""
    parser = argparse.ArgumentParser(prog="hf-memo", description="Long-context training for Hugging Face Transformers.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        subparser = subparsers.add_parser(name, help=help_text, description=help_text)
        if name == command:
            importlib.import_module(module).add_parser(subparser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; bad input exits with code 2 and a one-line reason, no traceback."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    args = build_parser(command).parse_args(argv)
    try:
        return importlib.import_module(SUBCOMMANDS[args.command][0]).run(args) or 0
    except (ValueError, FileNotFoundError) as error:
        print(f"hf-memo {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
