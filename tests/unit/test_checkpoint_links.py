"""``checkpoints/last`` copied as a real directory, and a re-save of a step cut between its two renames: neither
loses a checkpoint. Single-process manager, real files; the crash is a real SIGKILL of a child process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from safetensors.torch import load_file

from lerobot_mg.checkpoint import layout as L
from lerobot_mg.checkpoint.manager import CheckpointManager
from lerobot_mg.checkpoint.resume import check_resumable
from lerobot_mg.distributed.parallel_dims import ParallelDims
from lerobot_mg.errors import ConfigError
from tests.launch_utils import REPO, clean_env
from tests.unit.test_checkpoint_layout import Run

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _weights(step_dir: Path) -> dict:
    return load_file(str(step_dir / L.PRETRAINED_MODEL_DIR / L.MODEL_SAFETENSORS))


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)


def _dereference(link: Path) -> None:
    """What ``rsync -L`` (or a sync that follows links) leaves: the link replaced by a full copy of its target."""
    target = link.resolve()
    link.unlink()
    subprocess.run(["cp", "-a", str(target), str(link)], check=True)


def test_last_copied_as_a_directory_resumes_and_the_next_save_moves_it_to_its_step(tmp_path: Path) -> None:
    """A run copied without its links (only `last` made it, as a directory): the next save works, `last` is a link
    again, and the copied checkpoint is kept under its step's name."""
    run = Run(tmp_path)
    run.save(2)
    root = L.checkpoints_root(tmp_path)
    saved = _weights(root / "000002")
    _dereference(root / L.LAST_LINK)
    os.rename(root / "000002", tmp_path / "elsewhere")  # the numbered directory did not come along
    check_resumable(L.checkpoint_dir_from_config_path(root / "last/pretrained_model/train_config.json"))

    resumed = Run(tmp_path)  # a new start in the copied directory
    resumed.save(3)
    assert os.readlink(root / L.LAST_LINK) == "000003"
    assert sorted(os.listdir(root)) == ["000002", "000003", "last"]
    assert _same(_weights(root / "000002"), saved)
    check_resumable(root / "000002")


def test_last_copied_beside_its_step_is_kept_as_a_copy(tmp_path: Path) -> None:
    """`rsync -L` of the whole run: `last` and `000002` are two copies; the save keeps both (nothing deleted)."""
    run = Run(tmp_path)
    run.save(2)
    root = L.checkpoints_root(tmp_path)
    _dereference(root / L.LAST_LINK)
    Run(tmp_path).save(3)
    assert os.readlink(root / L.LAST_LINK) == "000003"
    assert sorted(os.listdir(root)) == ["000002", "000003", "last", "last.copy-000002"]
    assert _same(_weights(root / "last.copy-000002"), _weights(root / "000002"))
    assert [d.name for d in L.complete_step_dirs(tmp_path)] == ["000002", "000003"]  # the copy is never pruned


def test_a_failed_second_rename_of_a_resave_puts_the_earlier_copy_back(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    run = Run(tmp_path)
    root = L.checkpoints_root(tmp_path)
    earlier = _weights(run.save(1))
    real_replace = os.replace

    def refuse_new_copy(src: os.PathLike, dst: os.PathLike) -> None:
        if Path(src).name == f"{L.TMP_PREFIX}000001":
            raise PermissionError(13, "Permission denied", str(dst))
        real_replace(src, dst)

    monkeypatch.setattr("lerobot_mg.checkpoint.manager.os.replace", refuse_new_copy)
    with pytest.raises(ConfigError, match=r"Permission denied: .*000001'; .* the previous checkpoint .*000001 is intact"):
        run.save(1)  # a disk that refuses the save: the one-line user error
    monkeypatch.undo()
    assert _same(_weights(root / "000001"), earlier)
    assert os.readlink(root / L.LAST_LINK) == "000001" and check_resumable(root / "000001")["step"] == 1


_CRASH_BETWEEN_RENAMES = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    from tests.unit.test_checkpoint_layout import Run

    run = Run(Path(sys.argv[1]))
    run.save(1)
    real_replace = os.replace

    def crash_before_new_copy(src, dst):
        if Path(src).name == ".tmp-000001":  # the earlier copy is already renamed away
            os.kill(os.getpid(), signal.SIGKILL)
        real_replace(src, dst)

    os.replace = crash_before_new_copy
    run.save(1)
""")


def test_a_crash_between_the_renames_of_a_resave_loses_no_step(tmp_path: Path) -> None:
    """A process killed after the earlier copy of step 1 was renamed away and before the new copy took its name:
    the next start puts the earlier copy back (today's code had both under .tmp-, which that start deletes)."""
    proc = subprocess.run([sys.executable, "-c", _CRASH_BETWEEN_RENAMES, str(tmp_path)], cwd=REPO,
                          env=clean_env({"PYTHONPATH": str(REPO)}), capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    root = L.checkpoints_root(tmp_path)
    assert not (root / "000001").exists()  # the crash window: neither copy has the step's name
    assert {p.name for p in root.iterdir()} == {f"{L.REPLACED_PREFIX}000001", f"{L.TMP_PREFIX}000001", "last"}
    earlier = _weights(root / f"{L.REPLACED_PREFIX}000001")

    CheckpointManager(tmp_path, "safetensors", None, ParallelDims.resolve(1, 1, 1))  # the next start's cleanup
    assert sorted(os.listdir(root)) == ["000001", "last"]
    assert (root / L.LAST_LINK).resolve() == (root / "000001").resolve()
    assert check_resumable(root / "000001")["step"] == 1 and _same(_weights(root / "000001"), earlier)


def test_a_start_after_the_new_copy_arrived_drops_the_earlier_one(tmp_path: Path) -> None:
    """Killed after the second rename, before the earlier copy was deleted: the new copy stays."""
    run = Run(tmp_path)
    root = L.checkpoints_root(tmp_path)
    new = _weights(run.save(1))
    subprocess.run(["cp", "-a", str(root / "000001"), str(root / f"{L.REPLACED_PREFIX}000001")], check=True)
    CheckpointManager(tmp_path, "safetensors", None, ParallelDims.resolve(1, 1, 1))
    assert sorted(os.listdir(root)) == ["000001", "last"] and _same(_weights(root / "000001"), new)
