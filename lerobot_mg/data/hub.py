"""Where a run's dataset lives on disk: ``dataset.root``, or ``dataset.repo_id`` resolved the way LeRobot resolves it.

``dataset.repo_id=<user>/<name>`` is looked up in LeRobot's own cache, ``$HF_LEROBOT_HOME/<repo_id>`` (by default
``$HF_HOME/lerobot/<repo_id>``, i.e. ``~/.cache/huggingface/lerobot/<repo_id>``), so a dataset a user already
downloaded with LeRobot is found and nothing is fetched. Otherwise it is downloaded there through ``huggingface_hub``
(``repo_type="dataset"``, at ``dataset.revision``). Every rank of a node resolves before any process group exists:
under a file lock beside the cache directory, the first rank to take it downloads, and the others wait for it and
find the complete copy (one download per node, or per shared filesystem). Offline (``HF_HUB_OFFLINE=1``) or without
a network, a dataset that is not cached is refused with one line naming the repo id, where it looked and the command
that fetches it.

``dataset.revision`` is what the run reads. A copy's revision is what huggingface_hub recorded when it downloaded
its files (``.cache/huggingface/download/<file>.metadata``: the commit of each file, written by ``hf download``,
LeRobot and this module alike) and, for a download of this module, the branch or tag it was asked for. A cached
copy of another commit is replaced online (downloaded again in place; files of the old commit that the new one
lacks are removed) and refused offline, in one line with the command that fetches the revision asked for. The run
facts (``DatasetSource``) record the commit the files read were downloaded at.

The same module says whether the Hub can be written to at all (offline, no token), for the start-up refusal of a
run that would publish its policy, and fetches a ``policy.path`` given as a Hub repo id: only the files a base is
loaded from (``POLICY_FILES``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock
from huggingface_hub import HfApi, snapshot_download
from huggingface_hub.errors import (
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from lerobot_mg.checkpoint import layout as L
from lerobot_mg.config.policy import is_repo_id
from lerobot_mg.config.schema import DATA_DIR, DatasetConfig
from lerobot_mg.data.cache import user_cache_dir
from lerobot_mg.data.meta import DATASET_SCOPE
from lerobot_mg.errors import ConfigError, config_error
from lerobot_mg.policies.base import CONFIG_NAME

INFO_FILE = Path("meta") / "info.json"
# Present in a cache directory while a download into it is in progress: a copy with it is incomplete (a download that
# was killed half-way), and is downloaded again (huggingface_hub keeps the files already complete).
INCOMPLETE_MARKER = ".lerobot_mg_download_incomplete"
# What a download of this module fetched, written beside the files: {"revision": asked for, "commit": downloaded}.
DOWNLOAD_RECORD = ".lerobot_mg_download.json"
# Where huggingface_hub records, per file of a local_dir download, the commit and etag it was downloaded at.
HF_DOWNLOAD_METADATA = Path(".cache") / "huggingface" / "download"
# The files of a pretrained_model/ that loading a base reads (lerobot_mg.peft.base, lerobot_mg.policies.saved_config,
# lerobot_mg.processors.pipeline): a Hub policy.path downloads these and nothing else (no optimizer state, no
# DCP shards, no card).
POLICY_FILES = (
    CONFIG_NAME, L.TRAIN_CONFIG_JSON, L.MODEL_SAFETENSORS, L.ADAPTER_CONFIG_JSON, L.ADAPTER_SAFETENSORS,
    "policy_preprocessor.json", "policy_preprocessor_step_*.safetensors",
    "policy_postprocessor.json", "policy_postprocessor_step_*.safetensors",
)
_TRUE = {"1", "ON", "YES", "TRUE"}
_COMMIT = re.compile(r"^[0-9a-f]{7,40}$")


@dataclass(frozen=True)
class DatasetSource:
    """Where the run's dataset was found: the directory read, and for a Hub dataset its repo id, the revision asked
    for, the commit the files read were downloaded at (None: the directory records none) and how it got there.
    Recorded in the run facts."""

    root: str
    repo_id: str | None = None
    revision: str | None = None
    commit: str | None = None
    how: str = "root"  # root (dataset.root as given) | cache (LeRobot's cache) | download (fetched by this start)


@dataclass(frozen=True)
class LocalCopy:
    """What a directory records of the Hub commit its files came from."""

    commits: frozenset[str]  # huggingface_hub's record per file: one commit for a consistent copy
    modified: tuple[str, ...]  # files changed after their download (their record no longer describes them)
    asked: str | None  # the branch, tag or commit a download of this module was asked for
    downloaded: str | None  # the commit that download fetched

    @classmethod
    def read(cls, directory: Path) -> LocalCopy:
        """Read the records, writing nothing (huggingface_hub's own reader creates lock files beside them)."""
        commits: set[str] = set()
        modified: list[str] = []
        metadata_dir = directory / HF_DOWNLOAD_METADATA
        for metadata in sorted(metadata_dir.rglob("*.metadata")) if metadata_dir.is_dir() else []:
            name = metadata.relative_to(metadata_dir).as_posix().removesuffix(".metadata")
            try:
                commit, _etag, timestamp = metadata.read_text().splitlines()[:3]
                stamp = float(timestamp)
                mtime = (directory / name).stat().st_mtime
            except (OSError, ValueError):
                continue  # a record of a file since deleted, or one huggingface_hub would discard too
            if mtime - 1 > stamp:  # huggingface_hub's own rule: the file changed after it was downloaded
                modified.append(name)
            else:
                commits.add(commit.strip())
        record: dict = {}
        if (directory / DOWNLOAD_RECORD).is_file():
            record = json.loads((directory / DOWNLOAD_RECORD).read_text())
        downloaded = record.get("commit")
        if not commits and downloaded:
            commits.add(downloaded)
        return cls(frozenset(commits), tuple(modified), record.get("revision"), downloaded)

    @property
    def commit(self) -> str | None:
        """The one commit every recorded file came from; None when there is none or several, or files changed."""
        return next(iter(self.commits)) if len(self.commits) == 1 and not self.modified else None

    def describe(self) -> str:
        if self.modified:
            return f"files changed since their download ({', '.join(self.modified[:3])})"
        if len(self.commits) > 1:
            return f"files of {len(self.commits)} commits ({', '.join(sorted(c[:12] for c in self.commits))})"
        return f"commit {self.commit}" if self.commit else "no record of the revision it was downloaded at"

    def pinned(self, revision: str | None) -> bool:
        """``revision`` is this copy's commit (spelled in full or shortened), or None: nothing to ask the Hub."""
        return revision is None or (self.commit is not None and _COMMIT.match(revision.lower()) is not None
                                    and self.commit.startswith(revision.lower()))

    def holds(self, revision: str | None, resolved: str | None = None) -> bool:
        """This copy is ``revision`` (a branch, tag or commit; None: any); ``resolved``: the commit the Hub says
        ``revision`` names now, when it could be asked. :meth:`describe` says what the copy is otherwise."""
        if revision is None:
            return True
        if self.commit is None:
            return False
        if resolved is not None:
            return resolved == self.commit
        wanted = revision.lower()
        # A commit spelled in full or shortened, or the branch or tag this copy was downloaded for (what it named then).
        return bool(_COMMIT.match(wanted) and self.commit.startswith(wanted)) or (
            revision == self.asked and self.commit == self.downloaded)


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


def _generated_or_shipped(root: Path) -> bool:
    """``root`` is a dataset this package ships (the PushT slice) or generates (the embedded demonstrations): a
    preset's dataset, no copy of any Hub repo."""
    root = root.expanduser().resolve()
    return any(folder == root or folder in root.parents
               for folder in (DATA_DIR.resolve(), (user_cache_dir() / "datasets").resolve()))


def resolve_dataset(cfg: DatasetConfig, env: Mapping[str, str] | None = None,
                    scope: str = DATASET_SCOPE) -> DatasetSource:
    """The directory the run reads (see the module docstring); downloads a Hub dataset that is not cached, or is
    cached at another revision. Called by every rank before any process group exists; raises a ConfigError when the
    dataset cannot be had at ``dataset.revision``. ``scope``: the config group ``cfg``'s keys were given in
    (``dataset``, or ``dataset.sources.<i>`` for a mixture's source), which its user errors name."""
    if cfg.root is not None:
        return _given_root(cfg, env, scope)
    if cfg.repo_id is None:
        raise config_error(
            f"{scope}.root", None,
            "dataset=lerobot reads a LeRobot v3.0 dataset from a directory or from the Hub, and neither is given",
            f"{scope}.root=<a LeRobot v3.0 dataset directory>, or {scope}.repo_id=<user>/<dataset>",
        )
    if not is_repo_id(cfg.repo_id):
        raise config_error(f"{scope}.repo_id", cfg.repo_id, "is not a Hub repo id <user>/<dataset>",
                           f"{scope}.repo_id=${{HF_USER}}/my_dataset")
    local_dir = lerobot_home(env) / cfg.repo_id
    offline = hub_offline(env)
    resolved = None
    if _is_complete(local_dir):  # LeRobot's cache, or a download of an earlier start
        copy = LocalCopy.read(local_dir)
        if not offline and not copy.pinned(cfg.revision):  # a branch or tag: which commit it names now
            resolved = _resolve_revision(cfg.repo_id, cfg.revision)
        if copy.holds(cfg.revision, resolved):
            return DatasetSource(str(local_dir), cfg.repo_id, cfg.revision, copy.commit, "cache")
        if offline:
            raise _another_revision(cfg, local_dir, copy, scope)
    elif offline:
        raise config_error(
            f"{scope}.repo_id", cfg.repo_id,
            f"is not in LeRobot's cache ({local_dir}), and HF_HUB_OFFLINE=1 forbids downloading it",
            f"fetch it while online: {fetch_command(cfg.repo_id, local_dir, cfg.revision)}, or "
            f"{scope}.root=<a local copy>",
        )
    local_dir.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{local_dir}.lock"):  # one download per node; the other ranks wait here, then find it
        if _is_complete(local_dir):  # another rank's download, finished while this one waited
            copy = LocalCopy.read(local_dir)
            if copy.holds(cfg.revision, resolved):
                return DatasetSource(str(local_dir), cfg.repo_id, cfg.revision, copy.commit, "cache")
        commit = download_dataset(cfg.repo_id, cfg.revision, local_dir, scope)
    return DatasetSource(str(local_dir), cfg.repo_id, cfg.revision, commit, "download")


def _given_root(cfg: DatasetConfig, env: Mapping[str, str] | None, scope: str) -> DatasetSource:
    """``dataset.root`` as given: refused when it cannot be ``dataset.repo_id``'s copy at ``dataset.revision``."""
    root = Path(cfg.root)
    if cfg.repo_id is not None and _generated_or_shipped(root):
        raise config_error(
            f"{scope}.repo_id", cfg.repo_id,
            f"is set together with {scope}.root={cfg.root} (a preset's dataset, which this package ships or "
            "generates), which is no copy of it and would be read instead",
            f"{scope}.root=null to read {cfg.repo_id} from LeRobot's cache or the Hub, or {scope}.repo_id=null to "
            "train on the preset's dataset",
        )
    copy = LocalCopy.read(root)
    if cfg.revision is None:
        return DatasetSource(str(root), cfg.repo_id, None, copy.commit, "root")
    resolved = None
    if cfg.repo_id is not None and not hub_offline(env) and copy.commit is not None and not copy.pinned(cfg.revision):
        resolved = _resolve_revision(cfg.repo_id, cfg.revision)
    if not copy.holds(cfg.revision, resolved):
        raise config_error(
            f"{scope}.revision", cfg.revision,
            f"{scope}.root={cfg.root} holds {copy.describe()}, not that revision, and a given {scope}.root is "
            "read as it is, never downloaded into",
            f"{scope}.revision=" + (copy.commit or "null") + f" to read {scope}.root as it is"
            + (f", or {scope}.root=null to read {cfg.repo_id} at that revision from LeRobot's cache"
               if cfg.repo_id is not None else ""),
        )
    return DatasetSource(str(root), cfg.repo_id, cfg.revision, copy.commit, "root")


def _resolve_revision(repo_id: str, revision: str | None) -> str | None:
    """The commit ``revision`` names on the Hub now; None when no revision is asked for or the Hub cannot be asked
    (the cached copy's own record then decides)."""
    if revision is None:
        return None
    try:
        return HfApi().dataset_info(repo_id, revision=revision).sha
    except Exception:  # no network, no such revision: the download, if one is needed, names the failure
        return None


def _another_revision(cfg: DatasetConfig, local_dir: Path, copy: LocalCopy, scope: str) -> ConfigError:
    """The user error of a cached copy that is not ``dataset.revision`` (or cannot be told to be), offline."""
    return config_error(
        f"{scope}.revision", cfg.revision,
        f"LeRobot's cache holds {cfg.repo_id} at {copy.describe()} ({local_dir}), not that revision (as far as "
        "can be told offline), and HF_HUB_OFFLINE=1 forbids fetching it",
        f"fetch it while online (a start online replaces the copy; by hand: rm -r {local_dir} && "
        f"{fetch_command(str(cfg.repo_id), local_dir, cfg.revision)}), or "
        + (f"{scope}.revision={copy.commit} to train on the cached copy" if copy.commit
           else f"{scope}.root=<a copy of that revision>"),
    )


def download_dataset(repo_id: str, revision: str | None, local_dir: Path, scope: str = DATASET_SCOPE) -> str:
    """Download the dataset repo at ``revision`` into ``local_dir`` (a copy of another commit there is updated in
    place: huggingface_hub fetches the files that differ, and files of the old commit the new one lacks are removed);
    returns the commit it downloaded. ``scope``: the config group its user errors name (see :func:`resolve_dataset`)."""
    fetch = fetch_command(repo_id, local_dir, revision)
    where = f"is not in LeRobot's cache ({local_dir})" + (" at that revision" if _is_complete(local_dir) else "")
    try:
        commit = HfApi().dataset_info(repo_id, revision=revision).sha or revision or "main"
        local_dir.mkdir(parents=True, exist_ok=True)
        (local_dir / INCOMPLETE_MARKER).touch()
        snapshot_download(repo_id, repo_type="dataset", revision=commit, local_dir=local_dir)
    except (RepositoryNotFoundError, RevisionNotFoundError) as error:
        what = f"revision {revision!r} of it" if isinstance(error, RevisionNotFoundError) else "it"
        raise config_error(f"{scope}.repo_id", repo_id, f"{where}, and the Hub has no {what} (or it is private and "
                           "no token with access is set)", "a dataset repo id you can read (hf auth login for a "
                           f"private one), or {scope}.revision=<an existing branch, tag or commit>") from error
    except Exception as error:  # no network (httpx's connection errors), a proxy, a full disk, offline mode
        reason = " ".join(f"{type(error).__name__}: {error}".split())[:200]
        raise ConfigError(f"{scope}.repo_id={repo_id!r}: {where}, and downloading it failed ({reason}). Fix: "
                          f"fetch it yourself: {fetch}, or {scope}.root=<a local copy>") from error
    _remove_other_commits(local_dir, commit)
    (local_dir / DOWNLOAD_RECORD).write_text(json.dumps({"revision": revision, "commit": commit}) + "\n")
    (local_dir / INCOMPLETE_MARKER).unlink()
    return commit


def _remove_other_commits(local_dir: Path, commit: str) -> None:
    """Remove the files huggingface_hub recorded at another commit than ``commit``: after a complete download of
    ``commit`` every file of it is recorded at it, so these belong to an earlier revision only (a stale episodes
    table among the current ones would be read as part of the dataset)."""
    metadata_dir = local_dir / HF_DOWNLOAD_METADATA
    for metadata in sorted(metadata_dir.rglob("*.metadata")) if metadata_dir.is_dir() else []:
        try:
            recorded = metadata.read_text().splitlines()[0].strip()
        except (OSError, IndexError):
            continue
        if recorded != commit:
            (local_dir / metadata.relative_to(metadata_dir).as_posix().removesuffix(".metadata")).unlink(
                missing_ok=True)
            metadata.unlink(missing_ok=True)


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
    that cache first unless it is there or ``HF_HUB_OFFLINE=1``: only ``POLICY_FILES``, what loading a base reads."""
    if Path(path).exists() or not is_repo_id(path):
        return path
    try:
        # Offline, the cached snapshot is read without listing the repo (which huggingface_hub would still try).
        return snapshot_download(path, repo_type="model", revision=revision, allow_patterns=list(POLICY_FILES),
                                 local_files_only=hub_offline())
    except Exception as error:  # not cached offline, no network, no such repo
        reason = " ".join(f"{type(error).__name__}: {error}".split())[:200]
        at = f" --revision {revision}" if revision else ""
        raise config_error(
            "policy.path", path, f"is no directory, and as a Hub model repo it could not be had ({reason})",
            f"policy.path=<run>/checkpoints/<step or last>/pretrained_model, or fetch it while online: hf download "
            f"{path}{at}",
        ) from error
