"""The base of every policy config: the fields all policies share, their checks, and the contract of the frames a
training sample holds.

Plain dataclasses of plain types (no torch): each policy's config is also the Hydra schema of its ``policy`` preset
(:data:`POLICY_CONFIGS`), so a typo or a wrong type fails at compose time and the config survives an OmegaConf round
trip. ``validate`` repeats the checks for a config built in Python or read from a checkpoint's config.json.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import ClassVar

from lerobot_mg.config.choices import FeatureType, NormalizationMode, check_choice
from lerobot_mg.config.recipe import TrainingPreset
from lerobot_mg.errors import config_error


def _default_vision_channels() -> list[int]:
    # Stage widths of our own small ResNet-style backbone (one BasicBlock per stage, total stride 16), trained from
    # scratch: no downloaded weights.
    return [32, 64, 128, 256]


def _lerobot_normalization_mapping() -> dict[str, NormalizationMode]:
    # LeRobot's ACT default: a feature type without an entry (ENV here) is passed through unchanged (IDENTITY).
    return {
        FeatureType.VISUAL.value: NormalizationMode.MEAN_STD,
        FeatureType.STATE.value: NormalizationMode.MEAN_STD,
        FeatureType.ACTION.value: NormalizationMode.MEAN_STD,
    }


def check_positive_ints(values: dict[str, int]) -> None:
    """Each ``policy.<name>`` of ``values`` is at least 1."""
    for name, value in values.items():
        if value < 1:
            raise config_error(f"policy.{name}", value, "must be >= 1", f"policy.{name}=1")


def is_repo_id(text: str) -> bool:
    """``<user or org>/<name>``, each part letters, digits, ``-``, ``_`` or ``.`` (the Hub's repo id shape)."""
    return re.fullmatch(r"[\w.-]+/[\w.-]+", text) is not None and ".." not in text


def empty_camera_key_names(count: int) -> list[str]:
    """LeRobot's names of ``count`` empty cameras: ``observation.images.empty_camera_<i>``."""
    return [f"observation.images.empty_camera_{index}" for index in range(count)]


def check_padded_widths(widths: dict[str, tuple[str, int]], features: dict[str, dict]) -> None:
    """Each feature ``key`` of ``widths`` (key -> (the field it is padded to, that field's value)) is at most as wide
    as the policy pads it to: a wider one would not fit the projection the padded vector enters."""
    for key, (name, limit) in widths.items():
        if key in features and (width := int(features[key]["shape"][-1])) > limit:
            raise config_error(f"policy.{name}", limit, f"the dataset's {key} has {width} dims, more than the "
                               f"{limit} the policy pads it to", f"policy.{name}={width}")


def _list_override(values: list[int]) -> str:
    return f"[{','.join(str(value) for value in values)}]"


@dataclass
class PolicyConfig:
    """What the policy base class and the trainer read from every policy config.

    The fields are LeRobot 0.6.1's ``PreTrainedConfig`` fields, with LeRobot's names, types and defaults (a
    pretrained_model/'s config.json holds exactly those, so LeRobot reads it), and after them the few that only
    lerobot_mg has, named in ``lerobot_mg_only_fields``: those live in the run's train_config.json.

    A subclass sets ``type`` (its preset's name), ``action_length_key``, ``action_delta_indices`` (and
    ``observation_delta_indices`` when it keeps an observation history), adds its own lerobot_mg-only names to
    ``lerobot_mg_only_fields``, and checks its own fields in ``check_fields``.
    """

    action_length_key: ClassVar[str]  # the field that sets len(action_delta_indices), e.g. chunk_size
    # "<module>:<class>" of the policy this config builds. A name, not an import: the policies layer sits above this
    # one, and a run imports only its own policy's module (lerobot_mg.policies.registry).
    policy_class_path: ClassVar[str]
    # Fields config.json never holds (LeRobot would refuse them); a subclass adds its own with `|`.
    lerobot_mg_only_fields: ClassVar[frozenset[str]] = frozenset({"path", "observation_keys", "vision_channels"})
    # Fields LeRobot reads only for a policy with a camera, with the value config.json gives them for a policy
    # without one (it builds no image encoder, and LeRobot's loader refuses a choice of ours); the run's own value
    # stays in train_config.json, which wins when the checkpoint is read back.
    camera_only_fields: ClassVar[dict[str, str]] = {}
    # Whether the policy takes a sample whose robot lacks one of its inputs: a state or action shorter than its
    # feature (padded, the padding kept out of the loss) or a camera (an empty image, masked). LeRobot's VLAs
    # do (max_state_dim, empty_cameras); a dataset mixture of robots that differ refuses a policy that does not.
    pads_missing_inputs: ClassVar[bool] = False

    type: str = ""
    # Frames of observation history the policy reads (1: the current frame only).
    n_obs_steps: int = 1
    # LeRobot's device and automatic mixed precision: read and kept for LeRobot, not acted on here (the launcher
    # picks the device, accelerator.mixed_precision the precision; null lets LeRobot pick its own device).
    device: str | None = None
    use_amp: bool = False
    # True in the config.json of a PEFT run (its directory holds an adapter on a base, as LeRobot writes it).
    use_peft: bool = False
    # LeRobot's publishing fields: at the end of training the main process uploads the final pretrained_model/ to
    # the model repo <user>/<name> with a model card. push_to_hub is true by default, as in LeRobot, so a repo id
    # alone publishes; push_to_hub=false keeps the repo id unused. private, tags and license describe the repo.
    push_to_hub: bool = True
    repo_id: str | None = None
    private: bool | None = None
    tags: list[str] | None = None
    license: str | None = None
    # The base a fine-tuned policy started from (set from policy.path), and its Hub revision for a repo id.
    pretrained_path: str | None = None
    pretrained_revision: str | None = None
    # Actions of a predicted chunk that run before the next prediction.
    n_action_steps: int = 1
    # Normalisation mode per feature type (VISUAL, STATE, ENV, ACTION): MEAN_STD, MIN_MAX (to [-1, 1]) or IDENTITY;
    # a type without an entry is left unchanged.
    normalization_mapping: dict[str, NormalizationMode] = field(default_factory=_lerobot_normalization_mapping)

    # --- lerobot_mg only (train_config.json) ---
    # A pretrained_model/ directory (or a Hub model repo id) to start from (config + weights + processors):
    # fine-tuning, with or without peft.*. Its config.json replaces this group's values; policy.* overrides on the
    # command line apply on top.
    path: str | None = None
    # Dataset keys fed to the policy; None means every `observation.*` key of the dataset.
    observation_keys: list[str] | None = None
    # Image encoder: the stage widths of our small backbone (lerobot_mg.policies.vision).
    vision_channels: list[int] = field(default_factory=_default_vision_channels)

    @property
    def mixed_parameter_dtypes(self) -> str | None:
        """The setting that builds the policy with trainable parameters of more than one dtype (LeRobot's bfloat16
        builds keep norms and projections in float32), as ``key=value``; None when every parameter has one dtype.
        FSDP2 shards such a policy only under mixed precision, which trains float32 master copies."""
        return None

    @property
    def empty_camera_keys(self) -> list[str]:
        """The cameras the policy reads that no dataset has (LeRobot's ``empty_cameras``): input features its
        config.json lists, whose images the policy makes all -1 with mask False; none unless the policy has them."""
        return []

    def data_keys(self, policy_features: Iterable[str], dataset_features: Collection[str]) -> list[str]:
        """The features a run reads from a dataset for a policy of ``policy_features``: all of them but the empty
        cameras the dataset lacks, which the policy fills itself, as LeRobot's pi0, pi0.5 and SmolVLA do."""
        empty = set(self.empty_camera_keys) - set(dataset_features)
        return [key for key in policy_features if key not in empty]

    @property
    def publishes(self) -> bool:
        """Whether the end of training uploads pretrained_model/ (a repo id is given and push_to_hub is on)."""
        return self.push_to_hub and self.repo_id is not None

    @property
    def observation_delta_indices(self) -> list[int] | None:
        """Frame offsets of the observation history (consecutive, ending at 0), or None for the current frame
        alone without a time dim."""
        return None

    @property
    def action_delta_indices(self) -> list[int]:
        """Frame offsets of the action chunk each sample loads; the first may be negative (the chunk starts in the
        past). Its length is set by the field ``action_length_key`` names."""
        raise NotImplementedError(f"{type(self).__name__} does not say which action frames a sample holds")

    def training_preset(self) -> TrainingPreset | None:
        """The policy's training recipe, LeRobot's ``get_optimizer_preset()`` and ``get_scheduler_preset()`` in one
        (None: the policy has none, and the unset optimizer.* / scheduler.* keys take lerobot_mg's defaults).

        With ``use_policy_training_preset`` (true by default) it fills every optimizer.* / scheduler.* key the run's
        config leaves unset (lerobot_mg.config.recipe). A subclass builds it from its own LeRobot fields, so that
        ``policy.optimizer_lr=...`` changes it as in LeRobot, every field set: e.g. pi0's::

            return TrainingPreset(
                OptimizerConfig(type=OptimizerType.adamw, lr=self.optimizer_lr, betas=list(self.optimizer_betas),
                                eps=self.optimizer_eps, weight_decay=self.optimizer_weight_decay,
                                grad_clip_norm=self.optimizer_grad_clip_norm, param_groups=[]),
                SchedulerConfig(type=SchedulerType.cosine_decay_with_warmup,
                                num_warmup_steps=self.scheduler_warmup_steps,
                                num_decay_steps=self.scheduler_decay_steps, decay_lr=self.scheduler_decay_lr))

        A parameter group of its own (LeRobot's ``get_optim_params`` groups) is a ``ParamGroupConfig`` in
        ``param_groups``; a policy without a schedule gives ``SchedulerConfig(type=SchedulerType.none)``.
        """
        return None

    def check_fields(self) -> None:
        """The policy's own checks (a subclass overrides it); the shared fields are checked by ``validate``."""

    def check_features(self, input_features: dict[str, dict], output_features: dict[str, dict]) -> None:
        """The policy's checks of the features a dataset gives it (``{key: {"type", "shape"}}``), at start-up
        before anything is built; a subclass overrides it."""

    def validate(self) -> None:
        """Raise a ConfigError naming ``policy.<field>``, the bad value and the fix."""
        preset = type(self).__dataclass_fields__["type"].default
        if self.type != preset:
            raise config_error("policy.type", self.type, f"does not match {type(self).__name__}", f"policy={preset}")
        check_positive_ints({"n_obs_steps": self.n_obs_steps, "n_action_steps": self.n_action_steps})
        if self.repo_id is not None and not is_repo_id(self.repo_id):
            raise config_error("policy.repo_id", self.repo_id, "is not a Hub repo id <user>/<name>",
                               "policy.repo_id=${HF_USER}/my_trained_policy")
        self.check_fields()
        if not self.vision_channels or any(width < 1 for width in self.vision_channels):
            raise config_error(
                "policy.vision_channels", list(self.vision_channels), "needs at least one positive stage width",
                f"policy.vision_channels={_list_override(_default_vision_channels())}",
            )
        for feature_type, mode in self.normalization_mapping.items():
            key = f"policy.normalization_mapping.{feature_type}"
            if feature_type not in FeatureType.values():
                raise config_error(
                    key, mode, f"{feature_type!r} is not a feature type ({', '.join(FeatureType.values())})",
                    f"~{key}",
                )
            check_choice(key, mode, NormalizationMode)
        if self.observation_keys is not None:
            bad_keys = [key for key in self.observation_keys if not key.startswith("observation.")]
            if not self.observation_keys or bad_keys:
                raise config_error(
                    "policy.observation_keys", list(self.observation_keys),
                    "must be a non-empty list of `observation.*` dataset keys",
                    "policy.observation_keys=[observation.state], or policy.observation_keys=null for all of them",
                )
