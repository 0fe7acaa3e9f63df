"""Publishing a ``pretrained_model/`` directory as a Hub model repo: the one upload path of the trainer's
``policy.repo_id`` (at the end of training) and of ``lerobot-mg-convert-dcp push_to_hub=<repo>`` (later, by hand).

The files uploaded are the top-level safetensors, json and md files of ``pretrained_model/`` (weights, config.json,
train_config.json, the processors, the model card README.md), never the DCP shards. A directory holding DCP shards
only is merged first (the converter's own merge, verified tensor by tensor), so what is published always loads with
``from_pretrained``. The upload reads the directory and never changes it: a failed upload leaves the checkpoint as
it was, and the error names it and the command that uploads it later.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from huggingface_hub import CommitOperationAdd, HfApi

from lerobot_mg.checkpoint import layout as L
from lerobot_mg.data.hub import hub_write_refusal
from lerobot_mg.errors import ConfigError

HUB_FILE_SUFFIXES = (".safetensors", ".json", ".md")
MODEL_CARD = "README.md"


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


def push_pretrained(pretrained_dir: Path, repo_id: str, commit_message: str, key: str = "policy.repo_id") -> str:
    """Upload ``pretrained_dir``'s hub files to the model repo ``repo_id`` (created if missing) in one commit;
    returns the commit URL. Raises :class:`UploadFailed` naming the directory and the command to retry."""
    pretrained_dir = Path(pretrained_dir)
    files = hub_upload_files(pretrained_dir)
    if not any(path.suffix == ".safetensors" for path in files):
        raise ConfigError(
            f"{pretrained_dir}: has no safetensors weights to publish. Fix: convert its DCP shards first "
            f"(lerobot-mg-convert-dcp checkpoint_dir={pretrained_dir}), then push_to_hub"
        )
    try:
        api = HfApi()
        api.create_repo(repo_id, repo_type="model", exist_ok=True)
        operations = [CommitOperationAdd(path_in_repo=path.name, path_or_fileobj=str(path)) for path in files]
        commit = api.create_commit(repo_id, operations, commit_message=commit_message, repo_type="model")
    except Exception as error:  # the network, the Hub, the token: whatever it is, the checkpoint stays as it was
        reason = " ".join(f"{type(error).__name__}: {error}".split())[:300]
        step_dir = pretrained_dir.parent if pretrained_dir.name == L.PRETRAINED_MODEL_DIR else pretrained_dir
        raise UploadFailed(
            f"{key}={repo_id}: the upload of {pretrained_dir} failed ({reason}). The checkpoint is complete "
            f"and kept at {step_dir}. Fix: upload it later with {upload_later_command(step_dir, repo_id)}"
        ) from error
    return str(commit.commit_url)
