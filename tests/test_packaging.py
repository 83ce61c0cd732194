"""Packaging: ``import hf_memo`` is light, yet the runtime finds its planner; the wheel ships what the demo needs."""

import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import torch

import hf_memo
from hf_memo.estimator import fit_cache

ROOT = Path(__file__).resolve().parents[1]

# A fresh interpreter: the package and its CLI import neither PyTorch nor Transformers. Reaching the patches directly
# (not through hf_memo's names) still gives the memo runtime a planner and a policy sizer: stand-ins for the
# integrations' functions, which take their place once imported.
LIGHT_IMPORT = """
import sys
import hf_memo, hf_memo.data, hf_memo.integrations.cli
heavy = [name for name in ("torch", "transformers", "peft", "datasets") if name in sys.modules]
assert not heavy, heavy
from hf_memo.patches import apply
from hf_memo.runtime import model_planner, policy_sizer
stand_ins = [model_planner._registered[0], policy_sizer._registered[0]]
assert "hf_memo.integrations.planning" not in sys.modules and "hf_memo.integrations.policy_sizing" not in sys.modules
from hf_memo.integrations.planning import plan_training_step
from hf_memo.integrations.policy_sizing import policy_working_bytes
assert [stand_in.resolve() for stand_in in stand_ins] == [plan_training_step, policy_working_bytes]
assert [model_planner._registered[0], policy_sizer._registered[0]] == [plan_training_step, policy_working_bytes]
assert hf_memo.apply is apply and hf_memo.MemoConfig.__module__ == "hf_memo.config"
"""


def test_import_hf_memo_is_light_and_the_runtime_still_finds_its_planner_and_sizer():
    result = subprocess.run([sys.executable, "-c", LIGHT_IMPORT], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert set(hf_memo.__all__) <= set(dir(hf_memo)) and all(getattr(hf_memo, name) for name in hf_memo.__all__)
    assert hf_memo.revert.__module__ == "hf_memo.patches.apply"


def test_wheel_ships_the_sample_license_and_py_typed_and_runs_the_demo_in_a_fresh_venv(tmp_path):
    source = tmp_path / "source"  # a copy: building writes build/ and *.egg-info beside the sources
    shutil.copytree(ROOT / "hf_memo", source / "hf_memo", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(source)],
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = tmp_path.glob("hf_memo-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {
        "hf_memo/py.typed",
        "hf_memo/data/longalpaca/sample.json",
        "hf_memo/data/longalpaca/sample_tokenizer/tokenizer.json",
        "hf_memo/data/longalpaca/sample_tokenizer/tokenizer_config.json",
        f"hf_memo-{hf_memo.__version__}.dist-info/licenses/LICENSE",
        "hf_memo/estimator/shipped_fits/manifest.json",
    }
    assert shipped <= names, shipped - names
    fits = {f"hf_memo/estimator/shipped_fits/{path.name}" for path in fit_cache.SHIPPED.glob(f"*{fit_cache.SUFFIX}")}
    assert fits and fits <= names, fits - names
    assert not [name for name in names if name.startswith(("examples/", "tests/", "benchmarks/"))]

    # torch and the rest come from this interpreter's site-packages; hf_memo must come from the wheel, not from the
    # editable checkout: a cwd outside the checkout and no PYTHONPATH
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    python, bin_dir = venv / "bin" / "python", venv / "bin"
    if sys.prefix != sys.base_prefix:
        # the suite runs from a virtual environment: --system-site-packages reaches the base Python's packages, not
        # this environment's, so its site-packages are named to the new one (plain paths: no editable finder)
        (site_packages,) = (venv / "lib").glob("python*/site-packages")
        (site_packages / "suite_packages.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"} | {"OMP_NUM_THREADS": "1"}
    work = tmp_path / "work"
    work.mkdir()

    def run(*command: str) -> subprocess.CompletedProcess:
        return subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=300)

    suite_torch = run(str(python), "-c", "import torch; print(torch.__file__)")
    assert Path(suite_torch.stdout.strip()) == Path(torch.__file__), suite_torch.stderr[-3000:]
    installed = run(str(python), "-m", "pip", "install", "--no-deps", "--no-index", str(wheel))
    assert installed.returncode == 0, installed.stderr[-3000:]
    where = run(
        str(python), "-c", "import hf_memo, hf_memo.data; print(hf_memo.__file__, hf_memo.data.LONGALPACA_SAMPLE)"
    )
    assert where.returncode == 0, where.stderr[-3000:]
    module, sample = (Path(path).resolve() for path in where.stdout.split())
    assert module.is_relative_to(venv.resolve()) and sample.is_relative_to(venv.resolve()) and sample.is_file()
    sources = run(str(python), "-c", "from hf_memo.estimator import fit_cache; print(fit_cache.fingerprint_parts())")
    assert sources.stdout.strip() == str(fit_cache.fingerprint_parts())  # the shipped fits answer from the wheel too
    version = run(str(bin_dir / "hf-memo"), "--version")
    assert version.stdout.strip() == f"hf-memo {hf_memo.__version__}"

    demo = run(str(bin_dir / "hf-memo"), "demo", "--steps", "1", "--seq-len", "16", "--output-dir", "demo")
    assert demo.returncode == 0, demo.stderr[-3000:]
    assert "fine-tuned on CPU for 1 steps" in demo.stdout and "from sample.json" in demo.stdout
    assert (work / "demo" / "hf_memo_plan.json").is_file() and (work / "demo" / "memory_timeline.png").is_file()
