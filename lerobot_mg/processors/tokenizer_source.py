"""Where a policy's tokenizer comes from: a local directory, or a Hub repo id through huggingface_hub's cache.

The vision-language-action policies tokenise the task instruction with their VLM's tokenizer: pi0 and pi0.5 with
PaliGemma's (``google/paligemma-3b-pt-224``, which LeRobot 0.6.1 hard-codes in their preprocessors), SmolVLA with its
VLM's (``policy.vlm_model_name``, ``HuggingFaceTB/SmolVLM2-500M-Video-Instruct`` by default). The name, as the
preprocessor's ``tokenizer_processor`` step records it, is read as LeRobot reads it: an existing directory (relative
to the working directory) is used as it is; anything else is a Hub model repo id.

A repo id is looked up in huggingface_hub's cache (``$HF_HUB_CACHE``, by default ``~/.cache/huggingface/hub``) and
only the tokenizer's files are fetched (``TOKENIZER_FILES``, never the model's weights): a tokenizer already cached is
used as it is, without asking the Hub; otherwise it is downloaded into the cache, unless ``HF_HUB_OFFLINE=1``, in which
case the start is refused in one line with the ``hf download`` command that fetches it. PaliGemma's repository is
gated: its files download only with a token of an account that accepted Google's licence on the repo's page.

:func:`check_tokenizers` is the start-up check (it runs before any process group, so a missing tokenizer is refused
before anything is built); the preprocessor's tokenizer step then finds the files in the cache.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from huggingface_hub import snapshot_download
from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

from lerobot_mg.config.policy import is_repo_id
from lerobot_mg.data.hub import hub_offline
from lerobot_mg.errors import config_error

# The tokenizer LeRobot 0.6.1's pi0 and pi0.5 preprocessors load (processor_pi0.py, processor_pi05.py).
PALIGEMMA_TOKENIZER = "google/paligemma-3b-pt-224"
# The files transformers' AutoTokenizer reads from a repo, and no weights: tokenizer.json / tokenizer.model /
# tokenizer_config.json, the small JSON files (special and added tokens, a BPE vocabulary, the model config it may
# read the tokenizer's class from) and a BPE merges file.
TOKENIZER_FILES = ("tokenizer*", "*.json", "merges.txt")
# Repos whose files download only after the account accepted a licence on the repo's page.
GATED_PREFIXES = ("google/paligemma",)
PREPROCESSOR_JSON = "policy_preprocessor.json"
TOKENIZER_STEP = "tokenizer_processor"


def download_command(repo_id: str) -> str:
    """The command that puts ``repo_id``'s tokenizer files into huggingface_hub's cache."""
    return f"hf download {repo_id}" + "".join(f' --include "{pattern}"' for pattern in TOKENIZER_FILES)


def _gated_note(repo_id: str) -> str:
    if repo_id.startswith(GATED_PREFIXES):
        return (f" ({repo_id} is gated: accept its licence on https://huggingface.co/{repo_id} first, and log in "
                "with that account: hf auth login)")
    return ""


def _has_tokenizer(directory: Path) -> bool:
    return (directory / "tokenizer.json").is_file() or (directory / "tokenizer_config.json").is_file()


def resolve_tokenizer(name: str, key: str, env: Mapping[str, str] | None = None) -> Path:
    """The directory holding tokenizer ``name``'s files (see the module docstring); ``key`` names the setting the name
    came from in the one-line refusal (a ConfigError) when it cannot be had; ``env``: the environment whose
    ``HF_HUB_OFFLINE`` counts (this process's by default)."""
    local = Path(name).expanduser()
    if local.is_dir():
        return local
    if not is_repo_id(name):
        raise config_error(key, name, "is neither a directory nor a Hub repo id <user>/<name>",
                           f"{key}=<a directory holding tokenizer.json and tokenizer_config.json, or a Hub repo id>")
    try:  # the cache first: a tokenizer fetched once is used as it is, offline or not, by every rank
        cached = Path(snapshot_download(name, repo_type="model", allow_patterns=list(TOKENIZER_FILES),
                                        local_files_only=True))
        if _has_tokenizer(cached):
            return cached
    except LocalEntryNotFoundError:  # not cached, or cached incompletely (its IncompleteSnapshotError)
        pass
    fix = f"fetch it while online: {download_command(name)}{_gated_note(name)}"
    if hub_offline(env):
        raise config_error(key, name, "is not in huggingface_hub's cache, and HF_HUB_OFFLINE=1 forbids downloading "
                           "its tokenizer", fix)
    try:
        fetched = Path(snapshot_download(name, repo_type="model", allow_patterns=list(TOKENIZER_FILES)))
    except GatedRepoError as error:
        raise config_error(key, name, "is a gated repo and this account has no access to it",
                           f"accept its licence on https://huggingface.co/{name}, log in with that account (hf auth "
                           "login), then start again") from error
    except RepositoryNotFoundError as error:
        raise config_error(key, name, "is no Hub model repo (or it is private and no token with access is set)",
                           f"a tokenizer's repo id or directory; for a private repo: hf auth login; {fix}") from error
    except Exception as error:  # no network, a proxy, a full disk
        reason = " ".join(f"{type(error).__name__}: {error}".split())[:200]
        raise config_error(key, name, f"is not in huggingface_hub's cache, and downloading its tokenizer failed "
                           f"({reason})", fix) from error
    if not _has_tokenizer(fetched):
        raise config_error(key, name, f"holds no tokenizer (no tokenizer.json or tokenizer_config.json in {fetched})",
                           f"{key}=<the repo id of a model with a tokenizer>")
    return fetched


def configured_tokenizer(policy_cfg: Any) -> tuple[str, str] | None:
    """(setting, tokenizer name) a new preprocessor of ``policy_cfg`` tokenises with; None for a policy without
    language (ACT, Diffusion). Read by field name: SmolVLA's ``vlm_model_name``; pi0's and pi0.5's
    ``tokenizer_name`` where the config has one (lerobot_mg only, for the tiny presets), else PaliGemma's."""
    policy_type = getattr(policy_cfg, "type", None)
    if policy_type == "smolvla":
        return "policy.vlm_model_name", str(policy_cfg.vlm_model_name)
    if policy_type in ("pi0", "pi05"):
        return "policy.tokenizer_name", str(getattr(policy_cfg, "tokenizer_name", None) or PALIGEMMA_TOKENIZER)
    return None


def saved_tokenizers(directory: Path) -> list[tuple[str, str]]:
    """(setting, tokenizer name) of every tokenizer step of the preprocessor saved in ``directory``."""
    manifest = Path(directory) / PREPROCESSOR_JSON
    if not manifest.is_file():
        return []
    steps = json.loads(manifest.read_text()).get("steps", [])
    return [(f"{manifest} steps[{index}].config.tokenizer_name", str(step["config"]["tokenizer_name"]))
            for index, step in enumerate(steps)
            if step.get("registry_name") == TOKENIZER_STEP and step.get("config", {}).get("tokenizer_name")]


def check_tokenizers(policy_cfg: Any, saved_dir: Path | None = None,
                     env: Mapping[str, str] | None = None) -> list[Path]:
    """The start-up check of a run's tokenizers: every tokenizer its preprocessor will load is on disk (a Hub one
    downloaded into huggingface_hub's cache now, unless offline), else one ConfigError line that says how to get it.
    ``saved_dir``: the directory whose saved preprocessor the run loads (the checkpoint it resumes, the base it
    fine-tunes), None for a new preprocessor built from ``policy_cfg``; ``env`` as for :func:`resolve_tokenizer`.
    Returns the directories found."""
    if saved_dir is not None:
        names = saved_tokenizers(saved_dir)
    else:
        configured = configured_tokenizer(policy_cfg)
        names = [] if configured is None else [configured]
    return [resolve_tokenizer(name, key, env) for key, name in names]

