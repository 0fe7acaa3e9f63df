"""The layers contract (.importlinter, run by `make lint`) holds for the package, and catches an import that points
up: a copy of the package whose config imports the training loop fails it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tests.launch_utils import PUSHT_SLICE, REPO, clean_env

LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def _lint(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", str(root / ".importlinter")], cwd=root,
                          env=clean_env({"PYTHONPATH": str(root)}), capture_output=True, text=True, timeout=300)


def test_the_package_keeps_its_layers() -> None:
    done = _lint(REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Layers point down KEPT" in done.stdout


def test_an_import_pointing_up_breaks_the_contract(tmp_path: Path) -> None:
    shutil.copy(REPO / ".importlinter", tmp_path / ".importlinter")
    shutil.copytree(REPO / "lerobot_mg", tmp_path / "lerobot_mg", ignore=shutil.ignore_patterns("__pycache__"))
    schema = tmp_path / "lerobot_mg" / "config" / "schema.py"
    schema.write_text(schema.read_text() + "\nimport lerobot_mg.train  # noqa: E402,F401\n")
    done = _lint(tmp_path)
    assert done.returncode != 0
    assert "lerobot_mg.config is not allowed to import lerobot_mg.train" in done.stdout, done.stdout


def test_an_act_training_process_imports_only_the_libraries_it_uses() -> None:
    """Every rank imports the training entry point: the libraries of another policy (diffusers), of PEFT, of the
    simulator and of video decoding (PyAV) stay unimported until a run asks for them (a second or more of start-up
    per process otherwise); building an ACT policy and reading the state items of the PushT slice import none of
    them, nor pandas (which pyarrow imports when a table goes through its dataset layer or ``to_numpy``)."""
    unused = ["diffusers", "pandas", "peft", "transformers", "mujoco", "gym_aloha", "av"]
    code = ("import sys\n"
            "import lerobot_mg.scripts_entry, lerobot_mg.train\n"
            "from lerobot_mg.data.lerobot_dataset import LeRobotDataset\n"
            "from lerobot_mg.data.meta import DatasetMeta\n"
            "from lerobot_mg.policies import get_policy_class\n"
            "get_policy_class('act')\n"
            f"dataset = LeRobotDataset(DatasetMeta.read({str(PUSHT_SLICE)!r}), {{'action': [0.0, 0.1]}}, [0, 1],\n"
            "                         keys=['observation.state', 'action'])\n"
            "dataset[0], dataset[len(dataset) - 1]\n"
            f"print(sorted(name for name in {unused!r} if name in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=clean_env({"PYTHONPATH": str(REPO)}),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout
