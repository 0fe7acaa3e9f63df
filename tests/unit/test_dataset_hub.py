"""dataset.revision is what a run reads; dataset.repo_id over a preset's dataset is refused; a Hub policy.path
fetches only the files a base is loaded from.

Local copies record their revision the way huggingface_hub records it (its own ``write_download_metadata``, which
``hf download``, LeRobot and our download call for every file). Nothing reaches the network: where a start must go
online, the two calls that would (``HfApi.dataset_info`` and ``snapshot_download``) are replaced by fakes that serve
a local "Hub" with huggingface_hub's own file filter and metadata writer; the verdicts are the module's own.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest
import torch
from huggingface_hub._local_folder import write_download_metadata
from huggingface_hub.utils import filter_repo_objects

from lerobot_mg.config.choices import DatasetName
from lerobot_mg.config.schema import DatasetConfig
from lerobot_mg.data import hub
from lerobot_mg.data.hub import DOWNLOAD_RECORD, POLICY_FILES, resolve_dataset, resolve_policy_path
from lerobot_mg.data.meta import DatasetMeta
from lerobot_mg.errors import ConfigError
from lerobot_mg.peft.base import BaseWeights, check_policy_path
from lerobot_mg.peft.lora import load_policy
from lerobot_mg.preflight import check_mixture
from lerobot_mg.processors.normalize import load_processors
from lerobot_mg.processors.pipeline import PIPELINE_NAMES
from lerobot_mg.run_facts import RunFacts
from scripts.synthetic_dataset import write_state_dataset
from tests.launch_utils import PUSHT_SLICE
from tests.unit.test_hub import _run_config

OLD = "1111111111111111111111111111111111111111"
NEW = "2222222222222222222222222222222222222222"
LEROBOT = Path(__file__).resolve().parents[1] / "fixtures" / "lerobot_0_6_1"


def _files(directory: Path) -> list[str]:
    return sorted(path.relative_to(directory).as_posix() for path in directory.rglob("*")
                  if path.is_file() and ".cache" not in path.relative_to(directory).parts)


def _downloaded(source: Path, local_dir: Path, commit: str) -> Path:
    """``source``'s files in ``local_dir`` as huggingface_hub leaves a download of ``commit`` there: each file with
    its metadata record (commit, etag, time)."""
    shutil.copytree(source, local_dir, dirs_exist_ok=True)
    for name in _files(source):
        write_download_metadata(local_dir, name, commit, etag=f"etag-{name}")
    return local_dir


def _cfg(**fields: object) -> DatasetConfig:
    return DatasetConfig(name=DatasetName.lerobot, **fields)


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "lr"


def _offline(home: Path) -> dict[str, str]:
    return {"HF_LEROBOT_HOME": str(home), "HF_HUB_OFFLINE": "1"}


# --- a cached copy offline --------------------------------------------------------------------------------------

def test_a_cached_copy_is_read_at_the_commit_huggingface_hub_recorded(home: Path) -> None:
    copy = _downloaded(PUSHT_SLICE, home / "me" / "ds", OLD)
    for revision in (None, OLD, OLD[:10]):  # no revision asked: the copy as it is; a commit, full or short
        source = resolve_dataset(_cfg(repo_id="me/ds", revision=revision), _offline(home))
        assert (source.root, source.revision, source.commit, source.how) == (str(copy), revision, OLD, "cache")


def test_a_cached_copy_of_another_commit_is_refused_offline_with_the_download_command(home: Path) -> None:
    copy = _downloaded(PUSHT_SLICE, home / "me" / "ds", OLD)
    with pytest.raises(ConfigError) as error:
        resolve_dataset(_cfg(repo_id="me/ds", revision=NEW), _offline(home))
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(f"dataset.revision='{NEW}': LeRobot's cache holds me/ds at commit {OLD} ({copy}), not "
                              "that revision"), message
    assert f"hf download me/ds --repo-type dataset --revision {NEW} --local-dir {copy}" in message
    assert message.endswith(f"or dataset.revision={OLD} to train on the cached copy"), message


@pytest.mark.parametrize("damage", ["branch_offline", "mixed", "modified", "no_record"])
def test_a_copy_whose_revision_cannot_be_told_is_refused_offline(home: Path, damage: str) -> None:
    copy = _downloaded(PUSHT_SLICE, home / "me" / "ds", OLD)
    revision = OLD
    if damage == "branch_offline":  # a tag offline: which commit it names cannot be asked
        revision, describe = "v3.0", f"commit {OLD}"
    elif damage == "mixed":  # a download of another revision over it, interrupted
        write_download_metadata(copy, "meta/info.json", NEW, etag="other")
        describe = f"files of 2 commits ({OLD[:12]}, {NEW[:12]})"
    elif damage == "modified":  # edited after its download
        stamp = time.time() + 3600  # after the record's download time (the copy keeps the source's older mtime)
        os.utime(copy / "meta" / "info.json", (stamp, stamp))
        describe = "files changed since their download (meta/info.json)"
    else:
        shutil.rmtree(copy / ".cache")
        describe = "no record of the revision it was downloaded at"
    with pytest.raises(ConfigError, match=rf"^dataset\.revision='{revision}': LeRobot's cache holds me/ds at "
                                          rf"{re.escape(describe)} \("):
        resolve_dataset(_cfg(repo_id="me/ds", revision=revision), _offline(home))


def test_a_branch_our_download_fetched_is_known_offline(home: Path) -> None:
    copy = _downloaded(PUSHT_SLICE, home / "me" / "ds", OLD)
    (copy / DOWNLOAD_RECORD).write_text(json.dumps({"revision": "main", "commit": OLD}))
    source = resolve_dataset(_cfg(repo_id="me/ds", revision="main"), _offline(home))
    assert (source.revision, source.commit) == ("main", OLD)


# --- online: the cached copy is replaced ------------------------------------------------------------------------

class FakeHub:
    """The Hub's two answers a start asks for, served from local folders: ``revisions[name] = commit`` and
    ``trees[commit] = folder``. The download writes what huggingface_hub writes (files and metadata)."""

    def __init__(self, revisions: dict[str, str], trees: dict[str, Path]) -> None:
        self.revisions, self.trees, self.downloads, self.asked = revisions, trees, [], []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        hub_ = self

        class Api:
            def dataset_info(self, repo_id: str, revision: str | None = None):
                hub_.asked.append(revision)
                sha = hub_.revisions.get(revision or "main", revision)
                return type("Info", (), {"sha": sha})()

        def snapshot_download(repo_id: str, *, repo_type: str, revision: str, local_dir: Path) -> str:
            hub_.downloads.append((repo_id, repo_type, revision))
            _downloaded(hub_.trees[revision], Path(local_dir), revision)
            return str(local_dir)

        monkeypatch.setattr(hub, "HfApi", Api)
        monkeypatch.setattr(hub, "snapshot_download", snapshot_download)


def test_online_a_cached_copy_of_another_commit_is_replaced_in_place(home: Path, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    old = write_state_dataset(tmp_path / "old", num_frames=600, episode_length=100, num_files=2)
    # The old revision had a second episodes file that the new one lacks: left beside it, it would be read.
    shutil.copy(old / "meta" / "episodes" / "chunk-000" / "file-000.parquet",
                old / "meta" / "episodes" / "chunk-000" / "file-001.parquet")
    new = write_state_dataset(tmp_path / "new", num_frames=400, episode_length=100, num_files=1, seed=1)
    copy = _downloaded(old, home / "me" / "ds", OLD)
    fake = FakeHub({"main": NEW}, {NEW: new})
    fake.install(monkeypatch)
    env = {"HF_LEROBOT_HOME": str(home)}
    source = resolve_dataset(_cfg(repo_id="me/ds", revision="main"), env)
    assert (source.root, source.revision, source.commit, source.how) == (str(copy), "main", NEW, "download")
    assert fake.downloads == [("me/ds", "dataset", NEW)]
    assert _files(copy) == sorted([*_files(new), DOWNLOAD_RECORD])  # nothing of the old revision is left
    assert DatasetMeta.read(copy).fingerprint == DatasetMeta.read(new).fingerprint
    # The next start finds the copy at the commit the Hub names: nothing is downloaded again, even offline.
    assert resolve_dataset(_cfg(repo_id="me/ds", revision="main"), env).how == "cache"
    assert resolve_dataset(_cfg(repo_id="me/ds", revision="main"), {**env, "HF_HUB_OFFLINE": "1"}).commit == NEW
    assert fake.downloads == [("me/ds", "dataset", NEW)]


def test_online_a_cached_copy_at_the_commit_the_hub_names_is_read_as_it_is(home: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    _downloaded(PUSHT_SLICE, home / "me" / "ds", OLD)  # downloaded by LeRobot: no record of the tag asked for
    fake = FakeHub({"v3.0": OLD}, {})
    fake.install(monkeypatch)
    source = resolve_dataset(_cfg(repo_id="me/ds", revision="v3.0"), {"HF_LEROBOT_HOME": str(home)})
    assert (source.commit, source.how, fake.downloads, fake.asked) == (OLD, "cache", [], ["v3.0"])
    # A commit the copy is at, or no revision: nothing to ask the Hub (a node without a network starts as offline).
    for revision in (OLD, OLD[:7], None):
        assert resolve_dataset(_cfg(repo_id="me/ds", revision=revision), {"HF_LEROBOT_HOME": str(home)}).commit == OLD
    assert fake.asked == ["v3.0"]


# --- dataset.root -----------------------------------------------------------------------------------------------

def test_a_given_root_records_its_commit_and_must_be_the_revision_asked_for(tmp_path: Path) -> None:
    root = _downloaded(PUSHT_SLICE, tmp_path / "mine", OLD)
    assert resolve_dataset(_cfg(root=str(root), repo_id="me/ds"), {}).commit == OLD
    assert resolve_dataset(_cfg(root=str(root), revision=OLD[:8]), {"HF_HUB_OFFLINE": "1"}).commit == OLD
    with pytest.raises(ConfigError, match=rf"^dataset\.revision='{NEW}': dataset\.root={root} holds commit {OLD}, "
                                          rf"not that revision.*Fix: dataset\.revision={OLD} to read dataset\.root as "
                                          r"it is, or dataset\.root=null to read me/ds at that revision"):
        resolve_dataset(_cfg(root=str(root), repo_id="me/ds", revision=NEW), {"HF_HUB_OFFLINE": "1"})
    plain = shutil.copytree(PUSHT_SLICE, tmp_path / "plain")  # no record at all
    assert resolve_dataset(_cfg(root=str(plain)), {}).commit is None
    with pytest.raises(ConfigError, match=r"holds no record of the revision it was downloaded at, not that "
                                          r"revision.*Fix: dataset\.revision=null to read dataset\.root as it is$"):
        resolve_dataset(_cfg(root=str(plain), revision="v3.0"), {})


# --- a mixture's source -----------------------------------------------------------------------------------------

def _mixture(second: str):
    """A two-source mixture run config: the PushT slice's first episodes, then ``second`` (a source as typed)."""
    return _run_config(["dataset=mixture", f"dataset.sources=[{{root: {PUSHT_SLICE}, episodes: [0, 1]}}, {second}]"])


def test_a_mixture_sources_revision_and_download_refusals_name_its_own_keys(home: Path, tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A source is found as one dataset is (the same rules), and each refusal names ``dataset.sources.<i>.*``, the
    keys the user typed, never the single dataset's ``dataset.*``."""
    copy = _downloaded(PUSHT_SLICE, home / "me" / "ds", OLD)
    cached = _mixture(f"{{repo_id: me/ds, revision: '{NEW}'}}")
    with pytest.raises(ConfigError) as error:
        check_mixture(cached, 1, _offline(home))
    assert str(error.value).startswith(f"dataset.sources.1.revision='{NEW}': LeRobot's cache holds me/ds at commit "
                                       f"{OLD} ({copy}), not that revision"), error.value
    assert str(error.value).endswith(f"or dataset.sources.1.revision={OLD} to train on the cached copy"), error.value
    given = _mixture(f"{{root: {copy}, revision: '{NEW}'}}")
    with pytest.raises(ConfigError, match=rf"^dataset\.sources\.1\.revision='{NEW}': dataset\.sources\.1\.root={copy} "
                                          rf"holds commit {OLD}, not that revision, and a given dataset\.sources\.1\.root "
                                          rf"is read as it is.*Fix: dataset\.sources\.1\.revision={OLD} to read "
                                          r"dataset\.sources\.1\.root as it is$"):
        check_mixture(given, 1, {"HF_HUB_OFFLINE": "1"})
    # Online, a source that is not cached is downloaded; a failed download names the source's keys too.

    class NoNetwork:
        def dataset_info(self, repo_id: str, revision: str | None = None):
            raise OSError("no network")

    monkeypatch.setattr(hub, "HfApi", NoNetwork)
    with pytest.raises(ConfigError) as error:
        check_mixture(_mixture("{repo_id: me/absent}"), 1, {"HF_LEROBOT_HOME": str(home)})
    assert str(error.value) == (
        f"dataset.sources.1.repo_id='me/absent': is not in LeRobot's cache ({home / 'me' / 'absent'}), and "
        "downloading it failed (OSError: no network). Fix: fetch it yourself: hf download me/absent --repo-type "
        f"dataset --local-dir {home / 'me' / 'absent'}, or dataset.sources.1.root=<a local copy>")
    # The same source as a run's one dataset: the single dataset's keys, as before.
    with pytest.raises(ConfigError, match=r"^dataset\.repo_id='me/absent': .*, or dataset\.root=<a local copy>$"):
        resolve_dataset(_cfg(repo_id="me/absent"), {"HF_LEROBOT_HOME": str(home)})


# --- dataset.repo_id over a preset's dataset --------------------------------------------------------------------

def test_a_repo_id_typed_over_a_presets_dataset_is_refused_not_ignored(tmp_path: Path) -> None:
    cfg = _run_config(["experiment=pusht_debug", "dataset.repo_id=someone/absent"])
    with pytest.raises(ConfigError) as error:
        resolve_dataset(cfg.dataset, {"HF_LEROBOT_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"})
    assert str(error.value) == (
        f"dataset.repo_id='someone/absent': is set together with dataset.root={PUSHT_SLICE} (a preset's dataset, "
        "which this package ships or generates), which is no copy of it and would be read instead. Fix: "
        "dataset.root=null to read someone/absent from LeRobot's cache or the Hub, or dataset.repo_id=null to "
        "train on the preset's dataset")
    # The fix it names: the repo id is what the run then looks for.
    fixed = _run_config(["experiment=pusht_debug", "dataset.repo_id=someone/absent", "dataset.root=null"])
    with pytest.raises(ConfigError, match=r"^dataset\.repo_id='someone/absent': is not in LeRobot's cache"):
        resolve_dataset(fixed.dataset, {"HF_LEROBOT_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"})
    # A root of the user's own with a repo id is that repo's copy, read as given (LeRobot's --dataset.root).
    mine = shutil.copytree(PUSHT_SLICE, tmp_path / "mine")
    assert resolve_dataset(_cfg(root=str(mine), repo_id="someone/absent"), {}).root == str(mine)


# --- the run facts ----------------------------------------------------------------------------------------------

def test_the_run_facts_name_the_commit_read_and_a_resume_on_another_commit_is_a_change(home: Path) -> None:
    copy = _downloaded(PUSHT_SLICE, home / "me" / "ds", OLD)
    source = dataclasses.asdict(resolve_dataset(_cfg(repo_id="me/ds", revision=None), _offline(home)))
    assert source == {"root": str(copy), "repo_id": "me/ds", "revision": None, "commit": OLD, "how": "cache"}
    facts = RunFacts(batch=None, topology=None, precision="no", checkpoint_format="safetensors",  # type: ignore[arg-type]
                     code_revision=None, dataset_fingerprint="f", lr_schedule={}, model={},  # type: ignore[arg-type]
                     rank_bytes=(), dataset_source=source)
    assert facts._source() == f" (me/ds@{OLD[:12]}, cache: {copy})"
    moved = dataclasses.replace(facts, dataset_source={**source, "commit": NEW, "how": "download"})
    assert [change.name for change in moved.changes_since(facts)] == ["dataset_source"]
    assert dataclasses.replace(facts, dataset_source={**source, "how": "download"}).changes_since(facts) == ()


# --- policy.path from the Hub -----------------------------------------------------------------------------------

def _serve_model_repo(repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """``snapshot_download`` of a model repo whose files are ``repo``'s: huggingface_hub's own filter picks the
    files the call allows, which land in a snapshot folder."""
    calls: list[dict] = []

    def snapshot_download(repo_id: str, *, repo_type: str, revision: str | None, allow_patterns: list[str],
                          local_files_only: bool) -> str:
        calls.append({"repo_id": repo_id, "repo_type": repo_type, "allow_patterns": allow_patterns,
                      "local_files_only": local_files_only})
        snapshot = tmp_path / "hub" / "snapshots" / "abc"
        for name in filter_repo_objects(_files(repo), allow_patterns=allow_patterns):
            (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(repo / name, snapshot / name)
        return str(snapshot)

    monkeypatch.setattr(hub, "snapshot_download", snapshot_download)
    return calls


def _with_extras(pretrained: Path, repo: Path) -> Path:
    """A model repo as people publish them: the pretrained_model files and what loading never reads."""
    shutil.copytree(pretrained, repo)
    for name in ("README.md", ".gitattributes", "training_state/optimizer_state.safetensors",
                 "pytorch_model_fsdp_0/__0_0.distcp", "pytorch_model_fsdp_0/.metadata", "eval/videos/episode_0.mp4",
                 "notes/policy_preprocessor.json"):
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_bytes(b"not read")
    return repo


def test_a_hub_policy_path_fetches_only_what_loading_reads_and_loads_from_it(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    pretrained = LEROBOT / "act_state" / "pretrained_model"  # a real LeRobot 0.6.1 checkpoint
    repo = _with_extras(pretrained, tmp_path / "repo")
    calls = _serve_model_repo(repo, tmp_path, monkeypatch)
    snapshot = Path(resolve_policy_path("someone/act_base", "main"))
    assert calls == [{"repo_id": "someone/act_base", "repo_type": "model", "allow_patterns": list(POLICY_FILES),
                     "local_files_only": False}]
    assert _files(snapshot) == _files(pretrained)  # every file of the checkpoint, and nothing else
    assert {f"{name}.json" for name in PIPELINE_NAMES} <= set(_files(snapshot))
    assert check_policy_path(str(snapshot)) is BaseWeights.FULL
    fetched, full = load_policy(snapshot).eval(), load_policy(pretrained).eval()
    for (name, ours), (_, theirs) in zip(fetched.state_dict().items(), full.state_dict().items(), strict=True):
        assert torch.equal(ours, theirs), name
    for ours, theirs in zip(load_processors(snapshot), load_processors(pretrained), strict=True):
        assert [type(step) for step in ours.steps] == [type(step) for step in theirs.steps]
        for step, other in zip(ours.steps, theirs.steps, strict=True):
            for key, value in step.state_dict().items():
                assert torch.equal(value, other.state_dict()[key]), key


def test_a_hub_adapter_fetches_its_adapter_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pretrained = LEROBOT / "act_state_lora" / "pretrained_model"
    repo = _with_extras(pretrained, tmp_path / "repo")
    _serve_model_repo(repo, tmp_path, monkeypatch)
    snapshot = Path(resolve_policy_path("someone/act_lora"))
    assert _files(snapshot) == [name for name in _files(pretrained) if name != "README.md"]
    assert check_policy_path(str(snapshot)) is BaseWeights.ADAPTER
