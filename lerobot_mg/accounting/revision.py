"""The code revision a run was started with: git commit and whether the working tree was dirty.

A learning curve can only be attributed to code when the code is pinned: a clean commit pins it, a dirty
tree does not. The answer must never stop a run, so anything that goes wrong (no git binary, not a
checkout, a repository without commits) reads as "unknown" (None) rather than raising.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

# The repository root when running from a source checkout: lerobot_mg/accounting/revision.py -> repo.
_PACKAGE_REPO_DIR = Path(__file__).resolve().parents[2]
_GIT_TIMEOUT_S = 10.0


def _git(repo_dir: Path, *args: str) -> str | None:
    try:
        completed = subprocess.run(
            ["git", "-C", str(repo_dir), *args],
            capture_output=True,
            text=True,
            timeout=_GIT_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if completed.returncode != 0:
        return None
    return completed.stdout


def code_revision(repo_dir: Path | None = None) -> dict:
    """Return {"commit": sha or None, "dirty": bool or None} for the checkout holding `repo_dir`.

    `repo_dir` defaults to the checkout this package is imported from. Untracked files count as dirty
    (a new module can change what runs); git-ignored files (run outputs) do not. Outside a checkout both
    values are None; in a checkout without commits the commit is None and dirty is still answered.
    """
    directory = _PACKAGE_REPO_DIR if repo_dir is None else Path(repo_dir)
    if _git(directory, "rev-parse", "--is-inside-work-tree") is None:
        return {"commit": None, "dirty": None}
    head = _git(directory, "rev-parse", "--verify", "--quiet", "HEAD")
    status = _git(directory, "status", "--porcelain")
    return {
        "commit": head.strip() if head else None,
        "dirty": None if status is None else bool(status.strip()),
    }
