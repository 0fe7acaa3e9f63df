"""``policy.path``: the base policy a fine-tuning run starts from, read from a ``pretrained_model/`` directory
written by lerobot_mg or by LeRobot 0.6.1 (its config.json, weights and processors), or a Hub model repo id whose
snapshot huggingface_hub has (or fetches) in its cache.

Three kinds of directory hold a loadable base: our own checkpoints and gathered safetensors
(``model.safetensors``), converted DCP checkpoints (the same file, written by ``lerobot-mg-convert-dcp``), and
PEFT runs (``adapter_model.safetensors``: the adapter is merged into its own base first). A directory holding
DCP shards only cannot be read without a process group of the saved topology, so it is refused before any
process group exists, with the command that converts it.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from safetensors import safe_open

from lerobot_mg.checkpoint import layout as L
from lerobot_mg.config.literal import literal_values
from lerobot_mg.config.loading import override_keys
from lerobot_mg.config.policy import PolicyConfig, is_repo_id
from lerobot_mg.config.schema import policy_config_class
from lerobot_mg.data.hub import resolve_policy_path
from lerobot_mg.errors import ConfigError, config_error
from lerobot_mg.policies.base import CONFIG_NAME, FeatureSpec, features_from_dataset
from lerobot_mg.policies.saved_config import SavedPolicy, build_config, read_saved_policy
from lerobot_mg.safe_paths import contained

# Fields of a base's config that say where the base itself came from or went, not how it is built: the
# fine-tuning run sets its own (its repo, whether it trains an adapter, the base it starts from).
_RUN_OWN_FIELDS = ("path", "repo_id", "push_to_hub", "use_peft", "pretrained_path", "pretrained_revision")
# The key of adapter_config.json's auto_mapping (PEFT's record of the base model) that holds the sha256 of the base's
# weights file; PEFT and LeRobot ignore it.
BASE_SHA256_KEY = "base_model_sha256"
_HASH_CHUNK_BYTES = 16 * 2**20
_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


class BaseWeights(enum.Enum):
    FULL = "model.safetensors"
    ADAPTER = "adapter_model.safetensors (merged into its own base)"


def check_policy_path(path: str) -> BaseWeights:
    """Which weights ``policy.path`` holds; raises the user error naming the fix when it holds none."""
    directory = Path(path)
    fix = "policy.path=<run>/checkpoints/<step or last>/pretrained_model"
    if not directory.is_dir():
        raise config_error("policy.path", path, "is not a directory", fix)
    if not (directory / CONFIG_NAME).is_file():
        raise config_error("policy.path", path, f"holds no {CONFIG_NAME}: it is not a pretrained_model directory", fix)
    if (directory / L.MODEL_SAFETENSORS).is_file():
        return BaseWeights.FULL
    if (directory / L.ADAPTER_SAFETENSORS).is_file() and (directory / L.ADAPTER_CONFIG_JSON).is_file():
        return BaseWeights.ADAPTER
    if (directory / L.MODEL_DCP_DIR).is_dir():
        raise config_error(
            "policy.path", path,
            f"holds DCP shards only ({L.MODEL_DCP_DIR}/, a checkpoint.format=dcp checkpoint), which load only "
            "after conversion",
            f"lerobot-mg-convert-dcp checkpoint_dir={path}, then rerun with the same policy.path",
        )
    raise config_error(
        "policy.path", path, f"holds neither {L.MODEL_SAFETENSORS} nor {L.ADAPTER_SAFETENSORS}: no weights", fix
    )


def base_features(path: str) -> tuple[dict[str, FeatureSpec], dict[str, FeatureSpec]]:
    """(input_features, output_features) the base was trained with."""
    saved = read_saved_policy(Path(path))
    return saved.input_features, saved.output_features


@dataclass(frozen=True)
class BaseRecord:
    """How an adapter checkpoint names the base it was trained on, so that others can load it.

    ``name`` is what adapter_config.json's ``base_model_name_or_path`` and config.json's ``pretrained_path`` say: the
    Hub repo id as typed for a Hub base (with its commit in ``revision``, PEFT's field for the base's revision), else
    the base's path relative to the current directory (where PEFT and LeRobot look for it), else, for a base outside
    the current directory, its absolute path (loaded back only with the digest, see :func:`adapter_base_path`).
    ``directory`` is where the base is on this machine: never written."""

    name: str
    revision: str | None
    directory: Path

    @classmethod
    def of(cls, typed: str, resolved: str) -> BaseRecord:
        """The record of ``policy.path`` as typed and as :func:`resolve_policy_path` resolved it (on a resume: the
        ``policy.pretrained_path`` the first start recorded, and the directory it resolved)."""
        directory = Path(resolved).resolve()
        if resolved != typed:  # a Hub repo id, resolved to its cached snapshot .../snapshots/<commit>; or a record
            return cls(typed, directory.name if directory.parent.name == "snapshots" else None, directory)
        here = Path.cwd().resolve()
        return cls(str(directory.relative_to(here)) if directory.is_relative_to(here) else str(directory), None,
                   directory)

    def sha256(self) -> str:
        return weights_sha256(self.directory)


def weights_sha256(directory: Path) -> str:
    """The sha256 of the weights file a base directory holds (model.safetensors, or a PEFT base's
    adapter_model.safetensors): the digest an adapter records of its base and checks when it is loaded. Read once
    per file version (its size and modification time) in a process."""
    weights = Path(directory) / L.MODEL_SAFETENSORS
    if not weights.is_file():
        weights = Path(directory) / L.ADAPTER_SAFETENSORS
    stat = weights.stat()
    return _file_sha256(str(weights), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _file_sha256(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def adapter_base_path(adapter_dir: Path, chain: tuple[Path, ...] = ()) -> str:
    """The base directory of the adapter in ``adapter_dir``, from its adapter_config.json.

    ``base_model_name_or_path`` is looked up where PEFT looks: a relative path in the current directory (a LeRobot
    adapter records ``--policy.path`` as typed, relative to the folder training ran in), inside it and nowhere else
    (``..`` and links out are refused); an absolute path as it is (what LeRobot records after
    ``--policy.path=/abs/base``, and lerobot_mg for a base outside its current directory): the user named that base
    when training, and its digest is shown and recorded by the run that reads it (:func:`base_lineage`); else a Hub
    repo id at the recorded ``revision``, through huggingface_hub's cache. Where the adapter records the digest of its
    base's weights (``auto_mapping.base_model_sha256``, as lerobot_mg writes it), the base found must have it:
    another base is refused by name. A base that leads back to the adapter (``chain``: the adapters loaded on the way
    here) is refused."""
    adapter_dir = Path(adapter_dir).resolve()
    source = adapter_dir / L.ADAPTER_CONFIG_JSON
    recorded, revision, digest = _recorded_base(source)
    base = _locate_base(recorded, revision, source)
    if base == adapter_dir or base in chain:
        raise ConfigError(f"{source}: base_model_name_or_path={recorded!r} leads back to the adapter "
                          f"{'itself' if base == adapter_dir else base}, which would load without end. Fix: set it "
                          "to the base the adapter was trained on")
    if digest is not None and weights_sha256(base) != digest:
        raise ConfigError(
            f"{source}: the adapter was trained on the base {recorded} whose weights have sha256 {digest[:12]}..., "
            f"and {base} holds other weights (sha256 {weights_sha256(base)[:12]}...). Fix: the base it was trained on"
            f"{f' (revision {revision})' if revision else ''}, at {recorded}"
        )
    return str(base)


def _recorded_base(source: Path) -> tuple[str, str | None, str | None]:
    """What an adapter_config.json says of its base: ``base_model_name_or_path``, ``revision`` and the digest of its
    weights (None where not recorded)."""
    try:
        saved = json.loads(source.read_text())
    except json.JSONDecodeError as error:
        raise ConfigError(f"{source}: is not valid JSON ({error}). Fix: the adapter_config.json PEFT wrote") from error
    saved = saved if isinstance(saved, dict) else {}
    recorded, revision = saved.get("base_model_name_or_path"), saved.get("revision")
    mapping = saved.get("auto_mapping")
    digest = mapping.get(BASE_SHA256_KEY) if isinstance(mapping, dict) else None
    if not isinstance(recorded, str) or not recorded:
        raise ConfigError(f"{source}: records no base_model_name_or_path. Fix: set it to the base's pretrained_model "
                          "directory, relative to the current directory, or to its Hub repo id")
    return recorded, revision if isinstance(revision, str) else None, digest if isinstance(digest, str) else None


def base_lineage(path: str) -> list[dict[str, str]]:
    """The weights the base at ``path`` (an adapter directory) is made of, from ``path`` down to the full weights
    under it: ``{"path", "sha256"}`` each, ``path`` as the adapter above names it (the first: as resolved here). What
    the banner shows and the run's facts record (checkpoints included), so that a base read by an absolute path that
    no digest pins is named with the weights it held."""
    directory, chain = Path(path).resolve(), ()
    lineage = [{"path": str(directory), "sha256": weights_sha256(directory)}]
    while not (directory / L.MODEL_SAFETENSORS).is_file():
        recorded, _, _ = _recorded_base(directory / L.ADAPTER_CONFIG_JSON)
        chain = (*chain, directory)
        directory = Path(adapter_base_path(directory, chain))
        lineage.append({"path": recorded, "sha256": weights_sha256(directory)})
    return lineage


def _locate_base(recorded: str, revision: str | None, source: Path) -> Path:
    if Path(recorded).is_absolute():
        if not Path(recorded).is_dir():
            raise ConfigError(f"{source}: names the base {recorded}, which is not a directory here. Fix: restore the "
                              "base there, or set base_model_name_or_path to where it now lives")
        return Path(recorded).resolve()
    here = Path.cwd()
    if (here / recorded).exists() or not is_repo_id(recorded):  # a folder first, as PEFT and policy.path look
        fix = ("set base_model_name_or_path to the base's path relative to the current directory, or to its Hub "
               "repo id")
        base = contained(here, recorded, source, "base_model_name_or_path", fix, folder=True)
        if not base.is_dir():
            raise ConfigError(f"{source}: base_model_name_or_path={recorded!r} is read inside {here}, and is no "
                              f"directory there. Fix: {fix}")
        return base.resolve()
    try:
        return Path(resolve_policy_path(recorded, revision)).resolve()
    except ConfigError as error:
        cause = error.__cause__ or error
        reason = " ".join(f"{type(cause).__name__}: {cause}".split())[:200]
        at = f" --revision {revision}" if revision else ""
        raise ConfigError(
            f"{source}: names the base {recorded}, which is no directory under the current directory {here} (where "
            f"PEFT and LeRobot read a relative base), and as a Hub repo id it could not be had ({reason}). Fix: start "
            f"from the folder the adapter was trained in, or fetch the base while online: hf download {recorded}{at}"
        ) from error


def stored_dtype(path: str, chain: tuple[Path, ...] = ()) -> torch.dtype:
    """The floating dtype the base's weights are stored in (read from the file header, no tensor loaded); ``chain``:
    the adapters on the way here."""
    directory = Path(path)
    if not (directory / L.MODEL_SAFETENSORS).is_file():  # an adapter: the precision of its own base
        return stored_dtype(adapter_base_path(directory, chain), (*chain, directory.resolve()))
    with safe_open(str(directory / L.MODEL_SAFETENSORS), framework="pt") as weights:
        stored = {weights.get_slice(key).get_dtype() for key in weights.keys()}  # noqa: SIM118 (not a dict)
    floating = [_SAFETENSORS_DTYPES[name] for name in stored if name in _SAFETENSORS_DTYPES]
    return floating[0] if len(floating) == 1 else torch.float32


def _saved_config(saved: SavedPolicy, directory: Path) -> PolicyConfig:
    """The config a base's saved values build (not validated: the run validates its own at start-up)."""
    return build_config(policy_config_class(saved.type), {**saved.values, "type": saved.type},
                        directory / CONFIG_NAME, validate=False)


def check_dataset_matches(path: str, dataset_features: dict[str, dict[str, Any]]) -> None:
    """The dataset provides every input the base reads (but the empty cameras, which the policy fills itself), with
    the shapes it was trained on."""
    saved = read_saved_policy(Path(path))
    outputs = saved.output_features
    read = _saved_config(saved, Path(path)).data_keys(saved.input_features, dataset_features)
    inputs = {key: saved.input_features[key] for key in read}
    dataset_inputs, dataset_outputs = features_from_dataset(dataset_features, sorted(inputs))
    for name, (want, have) in {**{k: (inputs[k], dataset_inputs[k]) for k in inputs},
                               "action": (outputs["action"], dataset_outputs["action"])}.items():
        if list(want["shape"]) != list(have["shape"]):
            raise ConfigError(
                f"policy.path={path}: the base reads {name} of shape {want['shape']}, the dataset has "
                f"{have['shape']}. Fix: a dataset with the base's features, or another policy.path"
            )


def apply_policy_path(composed: DictConfig, overrides: list[str]) -> DictConfig:
    """``policy.path`` set: the policy group becomes the base's saved config (config.json, a LeRobot one too), with
    this command line's ``policy.*`` overrides on top (e.g. ``policy.dropout=0``), as LeRobot's ``--policy.path``
    does. The path is made absolute (``last`` resolved to its step; a Hub repo id to its cached snapshot), so a resume
    from another directory finds the same base; ``policy.pretrained_path`` records the base as others can find it
    (:class:`BaseRecord`: the Hub repo id as typed, or a path relative to the current directory)."""
    typed_path = str(composed.policy.path)
    revision = OmegaConf.select(composed, "policy.pretrained_revision")
    resolved = resolve_policy_path(typed_path, revision)
    check_policy_path(resolved)
    path = str(Path(resolved).resolve())
    kept = {
        key: OmegaConf.select(composed, key) for key in override_keys(overrides)
        if key.startswith("policy.") and key != "policy.path"
    }
    saved = read_saved_policy(Path(path))
    # The base's values fit its class's types (a wrong one is named here, not deep in OmegaConf); the run's config,
    # with the overrides on top, is validated at start-up.
    base_config = _saved_config(saved, Path(path))
    if saved.type != composed.policy.type:  # the base decides the policy: its schema replaces the preset's
        composed.policy = OmegaConf.structured(policy_config_class(saved.type))
    # The base's values as literal text: a "${...}" in a downloaded config.json is never resolved (see literal_values).
    base = {f"policy.{name}": literal_values(value, Path(path) / CONFIG_NAME, f"policy.{name}") for name, value in saved.values.items()
            if name not in _RUN_OWN_FIELDS}
    if saved.values.get("observation_keys") is None:  # a LeRobot base (or ours on every input): what it reads
        # from the dataset (its empty cameras are no dataset's features: the policy fills them)
        base["policy.observation_keys"] = base_config.data_keys(saved.input_features, ())
    run_own = {
        "policy.path": path,
        "policy.pretrained_path": BaseRecord.of(typed_path, resolved).name,
        "policy.use_peft": OmegaConf.select(composed, "peft.method_type") is not None,
    }
    for key, value in {**base, **run_own, **kept}.items():
        OmegaConf.update(composed, key, value, merge=False)
    return composed
