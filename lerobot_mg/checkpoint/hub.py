"""Publishing a ``pretrained_model/`` directory as a Hub model repo: the one upload path of the trainer's
``policy.repo_id`` (at the end of training) and of ``lerobot-mg-convert-dcp push_to_hub=<repo>`` (later, by hand).

The files uploaded are the top-level safetensors, json and md files of ``pretrained_model/`` (weights, config.json,
train_config.json, the processors, the model card README.md), never the DCP shards. A directory holding DCP shards
only is merged first (the converter's own merge, verified tensor by tensor), so what is published always loads with
``from_pretrained``.

The repo is published as LeRobot publishes it: config.json's ``private`` (``policy.private``) goes to
``create_repo``, and the model card's metadata carries ``license`` (LeRobot's ``apache-2.0`` when unset) and
``tags`` (the user's, with ``robotics``, ``lerobot`` and the policy type). ``private=true`` on a repo that already
exists and is public uploads nothing. The upload writes the card (README.md: the one a training run wrote, its
metadata completed, or a short one) and changes nothing else: a failed upload leaves the checkpoint complete, and the
error names it and the command that uploads it later.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from huggingface_hub import CommitOperationAdd, HfApi, ModelCard

from lerobot_mg.checkpoint import layout as L
from lerobot_mg.data.hub import hub_write_refusal
from lerobot_mg.errors import ConfigError

HUB_FILE_SUFFIXES = (".safetensors", ".json", ".md")
MODEL_CARD = "README.md"
DEFAULT_LICENSE = "apache-2.0"  # LeRobot's, when policy.license is unset
CARD_TAGS = ("robotics", "lerobot")  # LeRobot's tags of every policy card, with the policy type
_CONFIG_JSON = "config.json"


@dataclass(frozen=True)
class RepoSettings:
    """How the published repo describes itself: LeRobot's ``policy.private``, ``policy.license``, ``policy.tags``
    (recorded in config.json), and the policy type and dataset the card names."""

    private: bool | None = None
    license: str | None = None
    tags: tuple[str, ...] = ()
    policy_type: str | None = None
    dataset_repo_id: str | None = None

    @classmethod
    def of_pretrained(cls, pretrained_dir: Path) -> RepoSettings:
        """The settings a checkpoint recorded: config.json's ``private``, ``license``, ``tags`` and ``type``, and
        train_config.json's ``dataset.repo_id``."""
        config = _read_json(Path(pretrained_dir) / _CONFIG_JSON)
        dataset = _read_json(Path(pretrained_dir) / L.TRAIN_CONFIG_JSON).get("dataset") or {}
        return cls(config.get("private"), config.get("license"), tuple(config.get("tags") or ()), config.get("type"),
                   dataset.get("repo_id") if isinstance(dataset, dict) else None)

    def overridden(self, private: bool | None = None, license: str | None = None,  # noqa: A002 (LeRobot's name)
                   tags: list[str] | None = None) -> RepoSettings:
        """These settings with the values given (not None) in their place."""
        given: dict[str, Any] = {"private": private, "license": license,
                                 "tags": tuple(tags) if tags is not None else None}
        return replace(self, **{name: value for name, value in given.items() if value is not None})

    def card(self, existing: str | None, repo_id: str) -> str:
        """The model card: ``existing`` (the README.md a training run wrote) with its metadata completed (added to a
        card without any), or a short card; license and tags as LeRobot's ``generate_model_card`` sets them."""
        if existing is None:
            kind = f" ({self.policy_type})" if self.policy_type else ""
            existing = (f"\n# {repo_id}\n\nA policy{kind} trained with lerobot_mg, in LeRobot's `pretrained_model/` "
                        "layout: config.json, the weights and the processors.\n")
        card = ModelCard(existing if existing.startswith("---") else f"---\nlibrary_name: lerobot\n---\n{existing}")
        card.data.library_name = card.data.library_name or "lerobot"
        card.data.pipeline_tag = card.data.pipeline_tag or "robotics"
        card.data.license = self.license or card.data.license or DEFAULT_LICENSE
        wanted = [*CARD_TAGS, *([self.policy_type] if self.policy_type else []), *self.tags]
        card.data.tags = list(dict.fromkeys([*(card.data.tags or []), *wanted]))
        if self.dataset_repo_id and not card.data.datasets:
            card.data.datasets = [self.dataset_repo_id]
        return str(card)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ConfigError(f"{path}: is not valid JSON ({error}). Fix: a checkpoint lerobot_mg wrote") from error
    return value if isinstance(value, dict) else {}


class UploadFailed(ConfigError):
    """The upload did not complete. Printed like a user error (one line, no traceback, exit status 2): the message
    says where the complete checkpoint is and the command that uploads it later."""


def hub_upload_files(pretrained_dir: Path) -> list[Path]:
    """The files a push publishes: the top-level safetensors, json and md files (no DCP shards)."""
    return sorted(
        path for path in Path(pretrained_dir).iterdir()
        if path.is_file() and path.suffix in HUB_FILE_SUFFIXES
    )


def upload_later_command(step_dir: Path, repo_id: str) -> str:
    """The command that publishes ``step_dir`` (a ``checkpoints/<step>`` directory) to ``repo_id``."""
    return f"lerobot-mg-convert-dcp checkpoint_dir={shlex.quote(str(step_dir))} push_to_hub={repo_id}"


def check_can_push(key: str, repo_id: str) -> None:
    """Raise the user error when nothing can be uploaded from here (HF_HUB_OFFLINE=1, no token): before the run
    or the merge, not after it."""
    refusal = hub_write_refusal(when="after the merge", instead="drop push_to_hub and upload later")
    if refusal is not None:
        problem, fix = refusal
        raise ConfigError(f"{key}={repo_id}: {problem}. Fix: {fix}")


def push_pretrained(pretrained_dir: Path, repo_id: str, commit_message: str, key: str = "policy.repo_id",
                    settings: RepoSettings | None = None) -> str:
    """Write the model card, then upload ``pretrained_dir``'s hub files to the model repo ``repo_id`` (created if
    missing, private as ``settings`` say: by default what the checkpoint's config.json records) in one commit;
    returns the commit URL. Raises :class:`UploadFailed` naming the directory and the command to retry."""
    pretrained_dir = Path(pretrained_dir)
    if not any(path.suffix == ".safetensors" for path in hub_upload_files(pretrained_dir)):
        raise ConfigError(
            f"{pretrained_dir}: has no safetensors weights to publish. Fix: convert its DCP shards first "
            f"(lerobot-mg-convert-dcp checkpoint_dir={pretrained_dir}), then push_to_hub"
        )
    settings = settings or RepoSettings.of_pretrained(pretrained_dir)
    step_dir = pretrained_dir.parent if pretrained_dir.name == L.PRETRAINED_MODEL_DIR else pretrained_dir
    later = f"upload it later with {upload_later_command(step_dir, repo_id)}"
    try:  # the card first, so that the folder and the repo hold the same one (a read-only folder fails here)
        card_path = pretrained_dir / MODEL_CARD
        card_path.write_text(settings.card(card_path.read_text() if card_path.is_file() else None, repo_id))
        files = hub_upload_files(pretrained_dir)
        api = HfApi()
        api.create_repo(repo_id, repo_type="model", private=settings.private, exist_ok=True)
        refused_public = bool(settings.private) and not api.model_info(repo_id).private
        if not refused_public:
            operations = [CommitOperationAdd(path_in_repo=path.name, path_or_fileobj=str(path)) for path in files]
            commit = api.create_commit(repo_id, operations, commit_message=commit_message, repo_type="model")
    except Exception as error:  # the network, the Hub, the token: whatever it is, the checkpoint stays as it was
        reason = " ".join(f"{type(error).__name__}: {error}".split())[:300]
        raise UploadFailed(
            f"{key}={repo_id}: the upload of {pretrained_dir} failed ({reason}). The checkpoint is complete "
            f"and kept at {step_dir}. Fix: {later}"
        ) from error
    if refused_public:  # private=true asked for, and the repo exists as a public one: nothing is uploaded into it
        private_key = "policy.private" if key.startswith("policy.") else "private"
        raise UploadFailed(
            f"{key}={repo_id}: the repo exists and is public, and {private_key}=true: nothing was uploaded. The "
            f"checkpoint is complete and kept at {step_dir}. Fix: make the repo private on the Hub, then {later}"
        )
    return str(commit.commit_url)
