"""The ``hf-memo`` command line: version, ``python -m hf_memo``, light ``--help``, suggestions for typos."""

import subprocess
import sys

import pytest

import hf_memo
from hf_memo.integrations.cli import build_parser, did_you_mean, main

# --help and --version import neither PyTorch nor Transformers (hf-memo --help took ~6 s when they did)
HELP_IS_LIGHT = """
import sys
from hf_memo.integrations.cli import main
for flag in ("--help", "--version"):
    try:
        main([flag])
    except SystemExit as exit:
        assert exit.code == 0
heavy = [name for name in ("torch", "transformers", "datasets") if name in sys.modules]
assert not heavy, heavy
"""


def test_version_python_dash_m_and_a_light_help():
    for command in ([sys.executable, "-m", "hf_memo", "--version"], [sys.executable, "-c", HELP_IS_LIGHT]):
        result = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-1] == f"hf-memo {hf_memo.__version__}"
    assert "demo" in result.stdout and "estimate" in result.stdout


@pytest.mark.parametrize("command", ["demo", "estimate", "plan"])
def test_every_command_prints_its_help(command, capsys):
    """Help strings are %-formatted by argparse: a bare % in one (``75% of``) crashed ``--help``."""
    with pytest.raises(SystemExit) as exit:
        main([command, "--help"])
    assert exit.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: hf-memo {command}")


def test_a_mistyped_command_or_flag_gets_the_closest_one(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["estimat", "--model", "llama-3-8b"])
    assert exit.value.code == 2
    assert "no command 'estimat' (choose from demo, estimate, plan); did you mean estimate?" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["demo", "--stesp", "2", "--seq-lne=64"])
    err = capsys.readouterr().err
    assert err.startswith("usage: hf-memo demo")  # the command's own usage
    assert (
        "unrecognized arguments: --stesp 2 --seq-lne=64; did you mean --steps for --stesp, --seq-len for --seq-lne=64?"
        in err
    )
    with pytest.raises(SystemExit):
        main(["demo", "--xyzzy"])
    assert capsys.readouterr().err.endswith("unrecognized arguments: --xyzzy\n")  # nothing close: no guess


def test_did_you_mean():
    assert did_you_mean(["--gpu-memroy"], ["--gpu-memory", "--host-memory"]) == "; did you mean --gpu-memory?"
    assert did_you_mean(["--gpu-memroy=80GiB"], ["--gpu-memory", "--host-memory"]) == "; did you mean --gpu-memory?"
    assert did_you_mean(["--zzz", "80"], ["--gpu-memory"]) == ""


def test_build_parser_keeps_parse_known_args_for_callers_that_want_the_rest():
    args, rest = build_parser("demo").parse_known_args(["demo", "--steps", "2", "--stesp", "3"])
    assert (args.command, args.steps, rest) == ("demo", 2, ["--stesp", "3"])
