"""docs/config.md's tables of the config groups and experiment presets are what scripts/config_table.py writes from
conf/: every preset conf/ holds is listed, and a preset added to conf/ (or a table edited by hand) fails the check."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tests.launch_utils import REPO

SCRIPT = REPO / "scripts" / "config_table.py"
DOC = REPO / "docs" / "config.md"


def _check(doc: Path = DOC, conf: Path = REPO / "conf") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--check", "--doc", str(doc), "--conf", str(conf)],
                          capture_output=True, text=True, cwd=REPO)


def test_the_docs_tables_are_what_conf_gives() -> None:
    proc = _check()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr


def test_every_preset_of_conf_is_in_the_docs_table() -> None:
    text = DOC.read_text()
    presets = [path for path in (REPO / "conf").rglob("*.yaml")
               if path.parent != REPO / "conf" and path.parent.name != "help"]
    assert len(presets) > 30
    for path in presets:
        assert f"`{path.stem}`" in text, path
    for name in ("aloha_pi0_tiny", "aloha_pi05_tiny", "aloha_smolvla_tiny", "pi05_libero"):
        assert f"| `{name}` | `{name.split('_')[1] if name.startswith('aloha') else 'pi05'}` |" in text, name
    assert "| `dataset` | `embedded` (default), `lerobot`, `mixture` |" in text


def test_a_preset_added_to_conf_or_a_table_edited_by_hand_fails_the_check(tmp_path: Path) -> None:
    conf = shutil.copytree(REPO / "conf", tmp_path / "conf")
    (conf / "experiment" / "my_run.yaml").write_text("# @package _global_\n# My own run of ACT on the PushT slice. More words.\nsteps: 5\n")
    proc = _check(conf=conf)
    assert proc.returncode == 1 and "+| `my_run` | `act` | `embedded` | My own run of ACT on the PushT slice |" in proc.stdout, proc.stdout
    assert "Fix: python scripts/config_table.py" in proc.stderr
    edited = tmp_path / "config.md"
    edited.write_text(DOC.read_text().replace("`diffusion`, `pi0`, ", "`diffusion`, ", 1))
    assert _check(doc=edited).returncode == 1
    (conf / "newgroup").mkdir()
    (conf / "newgroup" / "a.yaml").write_text("x: 1\n")
    proc = _check(conf=conf)
    assert proc.returncode == 1 and "GROUP_NOTES lacks ['newgroup']" in proc.stdout + proc.stderr
