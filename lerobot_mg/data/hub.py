"""Where a run's dataset lives on disk: ``dataset.root``, or ``dataset.repo_id`` resolved the way LeRobot resolves it.

``dataset.repo_id=<user>/<name>`` is looked up in LeRobot's own cache, ``$HF_LEROBOT_HOME/<repo_id>`` (by default
``$HF_HOME/lerobot/<repo_id>``, i.e. ``~/.cache/huggingface/lerobot/<repo_id>``), so a dataset a user already
downloaded with LeRobot is found and nothing is fetched. Otherwise it is downloaded there through ``huggingface_hub``
(``repo_type="dataset"``, at ``dataset.revision``). Every rank of a node resolves before any process group exists:
under a file lock beside the cache directory, the first rank to take it downloads, and the others wait for it and
find the complete copy (one download per node, or per shared filesystem). Offline (``HF_HUB_OFFLINE=1``) or without
a network, a dataset that is not cached is refused with one line naming the repo id, where it looked and the command
that fetches it.

The same module says whether the Hub can be written to at all (offline, no token), for the start-up refusal of a
run that would publish its policy.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock
from huggingface_hub import HfApi, snapshot_download
from huggingface_hub.errors import (
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from lerobot_mg.config.policy import is_repo_id
from lerobot_mg.config.schema import DatasetConfig
from lerobot_mg.errors import ConfigError, config_error

INFO_FILE = Path("meta") / "info.json"
# Present in a cache directory while a download into it is in progress: a copy with it is incomplete (a download that
# was killed half-way), and is downloaded again (huggingface_hub keeps the files already complete).
INCOMPLETE_MARKER = ".lerobot_mg_download_incomplete"
# The commit a download fetched, written beside the files: a later start that finds the copy records the same revision.
DOWNLOADED_COMMIT = ".lerobot_mg_commit"
_TRUE = {"1", "ON", "YES", "TRUE"}


@dataclass(frozen=True)
class DatasetSource:
    """Where the run's dataset was found: the directory read, and for a Hub dataset its repo id, the revision asked
    for (or the commit downloaded) and how it got there. Recorded in the run facts."""

    root: str
    repo_id: str | None = None
    revision: str | None = None
    how: str = "root"  # root (dataset.root as given) | cache (LeRobot's cache) | download (fetched by this start)


def hub_offline(env: Mapping[str, str] | None = None) -> bool:
    """``HF_HUB_OFFLINE`` is set to a true value (huggingface_hub's own spelling: 1, ON, YES, TRUE)."""
    env = os.environ if env is None else env
    return env.get("HF_HUB_OFFLINE", "").upper() in _TRUE


def hub_token(env: Mapping[str, str] | None = None) -> str | None:
    """The token huggingface_hub would send: ``HF_TOKEN``, else the one ``hf auth login`` saved under ``HF_HOME``."""
    env = os.environ if env is None else env
    if env.get("HF_TOKEN"):
        return env["HF_TOKEN"]
    home = Path(env["HF_HOME"]) if env.get("HF_HOME") else _default_hf_home(env)
    token_file = Path(env.get("HF_TOKEN_PATH", home / "token"))
    return token_file.read_text().strip() or None if token_file.is_file() else None


def _default_hf_home(env: Mapping[str, str]) -> Path:
    cache = Path(env["XDG_CACHE_HOME"]) if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return cache / "huggingface"


def lerobot_home(env: Mapping[str, str] | None = None) -> Path:
    """LeRobot's dataset cache: ``$HF_LEROBOT_HOME``, else ``$HF_HOME/lerobot`` (``~/.cache/huggingface/lerobot``)."""
    env = os.environ if env is None else env
    if env.get("HF_LEROBOT_HOME"):
        return Path(env["HF_LEROBOT_HOME"]).expanduser()
    home = Path(env["HF_HOME"]).expanduser() if env.get("HF_HOME") else _default_hf_home(env)
    return home / "lerobot"


def fetch_command(repo_id: str, local_dir: Path, revision: str | None) -> str:
    """The command that puts the dataset where a run looks for it."""
    at = f" --revision {revision}" if revision else ""
    return f"hf download {repo_id} --repo-type dataset{at} --local-dir {local_dir}"


def _is_complete(directory: Path) -> bool:
    return (directory / INFO_FILE).is_file() and not (directory / INCOMPLETE_MARKER).exists()


def resolve_dataset(cfg: DatasetConfig, env: Mapping[str, str] | None = None) -> DatasetSource:
    """The directory the run reads (see the module docstring); downloads a Hub dataset that is not cached. Called by
    every rank before any process group exists; raises a ConfigError when the dataset cannot be had."""
    if cfg.root is not None:
        return DatasetSource(str(cfg.root), cfg.repo_id, cfg.revision, "root")
    if cfg.repo_id is None:
        raise config_error(
            "dataset.root", None,
            "dataset=lerobot reads a LeRobot v3.0 dataset from a directory or from the Hub, and neither is given",
            "dataset.root=<a LeRobot v3.0 dataset directory>, or dataset.repo_id=<user>/<dataset>",
        )
    if not is_repo_id(cfg.repo_id):
        raise config_error("dataset.repo_id", cfg.repo_id, "is not a Hub repo id <user>/<dataset>",
                           "dataset.repo_id=${HF_USER}/my_dataset")
    local_dir = lerobot_home(env) / cfg.repo_id
    if _is_complete(local_dir):  # LeRobot's cache, or a download of an earlier start
        return _cached(local_dir, cfg)
    if hub_offline(env):
        raise config_error(
            "dataset.repo_id", cfg.repo_id,
            f"is not in LeRobot's cache ({local_dir}), and HF_HUB_OFFLINE=1 forbids downloading it",
            f"fetch it while online: {fetch_command(cfg.repo_id, local_dir, cfg.revision)}, or "
            "dataset.root=<a local copy>",
        )
    local_dir.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{local_dir}.lock"):  # one download per node; the other ranks wait here, then find it
        if _is_complete(local_dir):
            return _cached(local_dir, cfg)
        commit = download_dataset(cfg.repo_id, cfg.revision, local_dir)
    return DatasetSource(str(local_dir), cfg.repo_id, commit, "download")


def _cached(local_dir: Path, cfg: DatasetConfig) -> DatasetSource:
    commit_file = local_dir / DOWNLOADED_COMMIT  # absent in a copy LeRobot downloaded: the revision asked for
    revision = commit_file.read_text().strip() if commit_file.is_file() else cfg.revision
    return DatasetSource(str(local_dir), cfg.repo_id, revision, "cache")


def download_dataset(repo_id: str, revision: str | None, local_dir: Path) -> str:
    """Download the dataset repo at ``revision`` into ``local_dir``; returns the commit it downloaded."""
    fetch = fetch_command(repo_id, local_dir, revision)
    where = f"is not in LeRobot's cache ({local_dir})"
    try:
        commit = HfApi().dataset_info(repo_id, revision=revision).sha or revision or "main"
        local_dir.mkdir(parents=True, exist_ok=True)
        (local_dir / INCOMPLETE_MARKER).touch()
        snapshot_download(repo_id, repo_type="dataset", revision=commit, local_dir=local_dir)
    except (RepositoryNotFoundError, RevisionNotFoundError) as error:
        what = f"revision {revision!r} of it" if isinstance(error, RevisionNotFoundError) else "it"
        raise config_error("dataset.repo_id", repo_id, f"{where}, and the Hub has no {what} (or it is private and "
                           "no token with access is set)", "a dataset repo id you can read (hf auth login for a "
                           "private one), or dataset.revision=<an existing branch, tag or commit>") from error
    except Exception as error:  # no network (httpx's connection errors), a proxy, a full disk, offline mode
        reason = " ".join(f"{type(error).__name__}: {error}".split())[:200]
        raise ConfigError(f"dataset.repo_id={repo_id!r}: {where}, and downloading it failed ({reason}). Fix: "
                          f"fetch it yourself: {fetch}, or dataset.root=<a local copy>") from error
    (local_dir / DOWNLOADED_COMMIT).write_text(commit + "\n")
    (local_dir / INCOMPLETE_MARKER).unlink()
    return commit


def hub_write_refusal(env: Mapping[str, str] | None = None, when: str = "at the end of training",
                      instead: str = "policy.push_to_hub=false to keep the checkpoint local and upload it later"
                      ) -> tuple[str, str] | None:
    """(problem, fix) when nothing can be uploaded to the Hub from here (offline, or no token); None when it can.
    ``when``: when the upload would have happened; ``instead``: the way to go on without it."""
    if hub_offline(env):
        return (f"HF_HUB_OFFLINE=1 is set, so the upload {when} could never happen",
                f"unset HF_HUB_OFFLINE (and log in: hf auth login), or {instead}")
    if hub_token(env) is None:
        return (f"no Hugging Face token is set (HF_TOKEN, or hf auth login), so the upload {when} would be refused",
                f"hf auth login (or export HF_TOKEN=<a write token>), or {instead}")
    return None


def resolve_policy_path(path: str, revision: str | None = None) -> str:
    """``policy.path``: a directory as given, or a Hub model repo id (``<user>/<name>``, as LeRobot accepts it, at
    ``revision``, default ``main``) resolved through huggingface_hub's own cache lookup: its cached snapshot
    (``$HF_HUB_CACHE/models--<user>--<name>/snapshots/<commit>``, what ``refs/<revision>`` names), downloaded into
    that cache first unless it is there or ``HF_HUB_OFFLINE=1``."""
    if Path(path).exists() or not is_repo_id(path):
        return path
    try:
        return snapshot_download(path, repo_type="model", revision=revision)
    except Exception as error:  # not cached offline, no network, no such repo
        reason = " ".join(f"{type(error).__name__}: {error}".split())[:200]
        at = f" --revision {revision}" if revision else ""
        raise config_error(
            "policy.path", path, f"is no directory, and as a Hub model repo it could not be had ({reason})",
            f"policy.path=<run>/checkpoints/<step or last>/pretrained_model, or fetch it while online: hf download "
            f"{path}{at}",
        ) from error
