"""The policy base class (save/load, observation history, action queue, FSDP wrap units) and dataset -> policy
features and frame offsets.

A feature spec is `{"type": "STATE" | "ENV" | "VISUAL" | "ACTION", "shape": [...]}` keyed by dataset key.
Policies see batches that the preprocessor already normalised and emit actions in normalised space; the
postprocessor maps them back (see lerobot_mg.processors).

Which frames a training sample holds is the policy config's business (`observation_delta_indices`,
`action_delta_indices`, as in LeRobot): `delta_timestamps` turns them into the dataset's offsets in seconds,
and `select_action` keeps the same observation history at inference.
"""

from __future__ import annotations

import abc
import functools
import json
from collections import deque
from pathlib import Path
from typing import Any, ClassVar

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lerobot_mg.config.policy import PolicyConfig
from lerobot_mg.errors import ConfigError, config_error
from lerobot_mg.policies.saved_config import (
    CONFIG_NAME,
    FeatureSpec,
    build_config,
    lerobot_config_dict,
    read_saved_policy,
)

WEIGHTS_NAME = "model.safetensors"
# Batch key of one int64 seed per sample (lerobot_mg.data.sampler.sample_seeds: a function of the run's seed, the
# epoch and the frame only). A policy that draws training noise per sample from it trains the same on every
# layout: the noise follows the sample, not the rank or the micro-batch it lands in.
SAMPLE_SEED_KEY = "sample_seed"
# Batch keys of a dataset mixture (lerobot_mg.data.mixture), where sources of different robots share one batch:
# the sample's source (its position in dataset.sources); per action dimension, True where it is padding (the source's
# action vector is shorter than the policy's: those dimensions never enter the loss); per camera, True where the
# sample's source has no such camera (its image is all zeros and the policy masks it out, as LeRobot's VLAs do an
# empty camera).
SOURCE_INDEX_KEY = "source_index"
ACTION_DIM_PAD_KEY = "action_dim_is_pad"


def empty_camera_key(camera: str) -> str:
    """The batch key that marks, per sample, a ``camera`` its source does not have."""
    return f"{camera}_is_empty"

_CHANNEL_AXIS_NAMES = ("channel", "channels", "c")
# The remedy when saved weights do not fit the policy their config.json builds.
_MISMATCH_FIX = "load a pretrained_model directory whose model.safetensors was saved with its config.json"


def _visual_shape_chw(key: str, spec: dict[str, Any]) -> list[int]:
    shape = [int(size) for size in spec["shape"]]
    if len(shape) != 3:
        raise ConfigError(
            f"the dataset's meta/info.json: image feature {key!r} has shape {shape}, not 3 dims (height, width, "
            f"channel). Fix: a dataset whose {key!r} is [height, width, channel], or leave {key!r} out of "
            "policy.observation_keys"
        )
    names = spec.get("names")
    # LeRobot writes images as HWC; some older datasets name the axes CHW. Trust names when present.
    if isinstance(names, list) and len(names) == 3 and str(names[0]).lower() in _CHANNEL_AXIS_NAMES:
        return shape
    height, width, num_channels = shape
    return [num_channels, height, width]


def features_from_dataset(
    dataset_features: dict[str, dict[str, Any]], observation_keys: list[str] | None
) -> tuple[dict[str, FeatureSpec], dict[str, FeatureSpec]]:
    """Map LeRobot `info.json` features to policy (input_features, output_features).

    `observation_keys=None` selects every `observation.*` key. Images/videos become VISUAL with shape C,H,W.
    """
    available = [key for key in dataset_features if key.startswith("observation.")]
    if observation_keys is None:
        selected = available
    else:
        missing = [key for key in observation_keys if key not in dataset_features]
        if missing:
            raise ConfigError(
                f"policy.observation_keys={list(observation_keys)}: the dataset has no feature {missing}. Fix: "
                f"policy.observation_keys=[{','.join(available)}] or a subset of it"
            )
        selected = list(observation_keys)
    if not selected:
        raise config_error(
            "policy.observation_keys", None if observation_keys is None else list(observation_keys),
            f"selects no observation.* feature of the dataset (its features: {sorted(dataset_features)}), and a "
            "policy needs at least one input",
            "policy.observation_keys=[<observation.* features of the dataset>], or a dataset (dataset.root) that "
            "has one",
        )
    if "action" not in dataset_features:
        raise ConfigError(
            f"the dataset's meta/info.json: declares no 'action' feature (its features: {sorted(dataset_features)}), "
            "and a policy learns to predict the action. Fix: a dataset (dataset.root) that records an 'action' "
            "feature"
        )

    input_features: dict[str, FeatureSpec] = {}
    for key in selected:
        spec = dataset_features[key]
        if spec.get("dtype") in ("image", "video"):
            input_features[key] = {"type": "VISUAL", "shape": _visual_shape_chw(key, spec)}
        elif key == "observation.environment_state":
            input_features[key] = {"type": "ENV", "shape": [int(size) for size in spec["shape"]]}
        else:
            input_features[key] = {"type": "STATE", "shape": [int(size) for size in spec["shape"]]}
    output_features: dict[str, FeatureSpec] = {
        "action": {"type": "ACTION", "shape": [int(size) for size in dataset_features["action"]["shape"]]}
    }
    return input_features, output_features


def delta_timestamps(
    config: PolicyConfig, dataset_features: dict[str, dict[str, Any]], fps: int
) -> dict[str, list[float]]:
    """Offsets in seconds of the frames each training sample holds, per dataset key: the action chunk, and the
    observation history of every input the policy reads (when the policy keeps one)."""
    offsets = {"action": list(config.action_delta_indices)}
    if config.observation_delta_indices is not None:
        input_features, _ = features_from_dataset(dataset_features, config.observation_keys)
        offsets.update({key: list(config.observation_delta_indices) for key in input_features})
    return {key: [index / fps for index in indices] for key, indices in offsets.items()}


def checkpoint_activations(module: nn.Module) -> None:
    """Recompute ``module``'s activations in backward instead of keeping them: its forward is replaced on the
    instance by a non-reentrant checkpoint of it (class, hooks, names and state dict unchanged). Used by
    ``accelerator.activation_checkpointing`` and by a policy's own ``gradient_checkpointing`` (LeRobot's name); a
    module already transformed is left as it is, so asking for both recomputes once.

    Non-reentrant checkpointing composes with DDP's and FSDP2's hooks and with torch.compile, and restores the RNG
    state for the recomputation, so dropout draws the same mask and gradients equal the run without it.
    """
    if getattr(module, "_recomputed_in_backward", False):
        return
    forward = module.forward

    @functools.wraps(forward)
    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = checkpointed  # type: ignore[method-assign]
    module._recomputed_in_backward = True  # type: ignore[assignment]


def safetensors_ready(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """CPU, contiguous tensors with no two sharing storage (safetensors refuses shared storage)."""
    seen_storages: set[int] = set()
    ready: dict[str, Tensor] = {}
    for key, tensor in state_dict.items():
        tensor = tensor.detach().cpu().contiguous()
        storage = tensor.untyped_storage()
        if storage.nbytes() > 0:
            if storage.data_ptr() in seen_storages:
                tensor = tensor.clone()
            else:
                seen_storages.add(storage.data_ptr())
        ready[key] = tensor
    return ready


def load_state_dict_strictly(module: nn.Module, state_dict: dict[str, Tensor], source: str, config_source: str) -> None:
    """Load ``state_dict`` into ``module``, every key or none: a missing or unexpected key, or a shape that does not
    fit, is a ConfigError naming the keys (nothing is ever left at its random init)."""
    try:
        missing, unexpected = module.load_state_dict(state_dict, strict=False)  # the keys are checked right below
    except RuntimeError as error:  # shape mismatches
        raise ConfigError(
            f"{source}: does not match the policy built from {config_source}: "
            f"{' '.join(str(error).split()).rstrip('.')}. Fix: {_MISMATCH_FIX}"
        ) from error
    if missing or unexpected:
        raise ConfigError(
            f"{source}: does not match the policy built from {config_source}: "
            f"missing keys {sorted(missing)}, unexpected keys {sorted(unexpected)}. Fix: {_MISMATCH_FIX}"
        )


class PreTrainedPolicy(nn.Module, abc.ABC):
    """Base of every policy: forward returns (loss, logs) on a normalised batch; save/load as safetensors."""

    name: ClassVar[str]
    config_class: ClassVar[type[PolicyConfig]]
    # Class names of the repeated blocks FSDP shards as units; the rest stays in the root unit.
    _fsdp_wrap_modules: ClassVar[list[str]] = []
    # Class names of the blocks accelerator.activation_checkpointing recomputes; empty: the wrap units. Declared
    # where wrap units chosen by size would make poor segments (a single conv, or a whole network at once).
    _checkpoint_modules: ClassVar[list[str]] = []
    # Module names (or name suffixes) that LoRA adapts when peft.target_modules is null, or one regular expression
    # full-matched against module names (as peft and LeRobot's VLAs spell it).
    _peft_target_modules: ClassVar[list[str] | str] = []

    def fsdp_unit_groups(self) -> list[tuple[nn.Module, ...]]:
        """Groups of modules that FSDP2 shards as ONE unit each (``fully_shard([m1, m2, ...])``), before the
        class-name units of ``_fsdp_wrap_modules``; empty (the default): none.

        The joint layer protocol of a vision-language-action policy (pi0, pi0.5, SmolVLA), which this declaration
        serves: joint layer ``i`` is the VLM decoder layer ``i`` and the action expert's layer ``i``, whose
        attention spans both streams, and the policy returns ``[(vlm_layer_i, expert_layer_i) for i]``.

        1. Both layers are modules whose ``forward`` does the work (no caller reaches into their norms,
           projections or MLP), and their state-dict names are LeRobot's.
        2. The policy calls ``vlm_layer_i(...)``, whose forward calls ``expert_layer_i(...)`` inside it, so the
           outer forward finishes last: a grouped unit gathers its parameters when the first module of the group
           starts its forward and reshards them after every module of the group has finished its own.
        3. Every pass calls both forwards, in training (both streams), in the prefix-only pass that fills the KV
           cache and in each denoising step (the suffix with the cached prefix). A stream that is absent is passed
           as ``None`` and its layer returns ``None`` without reading its weights.
        4. Weights tied between modules stay in one group (or both in the root).
        5. Activation checkpointing (``_checkpoint_modules``) names the VLM layer class: recomputing its forward
           recomputes the nested expert call too.

        ``parallelism.dp_shard=N`` then needs no ``accelerator.fsdp.*`` setting for the policy; its state dict,
        checkpoints and LeRobot's loading are unchanged by the grouping."""
        return []

    def example_batch(self, batch_size: int) -> dict[str, Tensor]:
        """A normalised training batch of ``batch_size`` zeros, made on the current default device (``with
        torch.device("meta")``: shapes only): every input feature (with its observation history), the action chunk
        and its padding mask. The memory plan runs it through a meta-device copy of the policy to estimate the
        activations; a sharded evaluation uses it to keep pace when a rank has no observation of its own. A policy
        that reads other keys (language tokens) extends it."""
        history = self.config.observation_delta_indices
        steps = [] if history is None else [len(history)]
        chunk = len(self.config.action_delta_indices)
        batch = {key: torch.zeros(batch_size, *steps, *spec["shape"]) for key, spec in self.input_features.items()}
        for key, spec in self.output_features.items():
            batch[key] = torch.zeros(batch_size, chunk, *spec["shape"])
        batch["action_is_pad"] = torch.zeros(batch_size, chunk, dtype=torch.bool)
        batch[SAMPLE_SEED_KEY] = torch.arange(batch_size, device="cpu")  # read on the host (lerobot_mg.step)
        return batch

    def unused_parameter_names(self) -> list[str]:
        """Names (as in ``named_parameters()``) of parameters the training loss never reads, so they never receive
        a gradient: pi0's and pi0.5's language-model heads, which LeRobot builds and saves but never calls.

        They stay in the policy and in every checkpoint (LeRobot loads its state dict strictly). Before training
        the run freezes them (:meth:`freeze_unused_parameters`: ``requires_grad=False``), so the optimizer holds no
        state for them, no gradient is allocated or reduced for them (DDP needs no ``find_unused_parameters``,
        FSDP2 reduce-scatters nothing for them), and the memory plan counts them as parameters only. Default: none.
        """
        return []

    def freeze_unused_parameters(self) -> list[str]:
        """Set ``requires_grad=False`` on :meth:`unused_parameter_names` (idempotent); returns the names. A name
        the policy does not have is a bug of its declaration (KeyError)."""
        names = self.unused_parameter_names()
        params = dict(self.named_parameters())
        for name in names:
            params[name].requires_grad_(False)
        return names

    def __init__(
        self,
        config: PolicyConfig,
        input_features: dict[str, FeatureSpec],
        output_features: dict[str, FeatureSpec],
    ) -> None:
        super().__init__()
        self.config = config
        self.input_features = {
            key: {"type": spec["type"], "shape": list(spec["shape"])} for key, spec in input_features.items()
        }
        self.output_features = {
            key: {"type": spec["type"], "shape": list(spec["shape"])} for key, spec in output_features.items()
        }
        self._action_queue: deque[Tensor] = deque(maxlen=config.n_action_steps)
        history = config.observation_delta_indices
        self._num_history_steps = None if history is None else len(history)
        self._observation_history: dict[str, deque[Tensor]] = {}

    @abc.abstractmethod
    def forward(self, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, float]]:
        """Training loss and float logs for a normalised batch holding `action` and `action_is_pad`."""

    @abc.abstractmethod
    def predict_action_chunk(self, batch: dict[str, Tensor]) -> Tensor:
        """(B, len(action_delta_indices), action_dim) actions in normalised space, for the frames at
        `action_delta_indices`. With an observation history, each input of `batch` is (B, T, ...)."""

    @torch.no_grad()
    def select_action(self, batch: dict[str, Tensor]) -> Tensor:
        """(B, action_dim): the next action for the current observations `batch` (no time dim), predicting a
        new chunk once the last n_action_steps are used. The policy keeps its own observation history.

        Call `eval()` first and `reset()` at each episode start.
        """
        if self._num_history_steps is not None:
            batch = self._push_observation(batch)
        if not self._action_queue:
            # Chunk position of the current frame: the chunk may start in the past (action_delta_indices[0] < 0).
            now = -self.config.action_delta_indices[0]
            chunk_BTA = self.predict_action_chunk(batch)[:, now : now + self.config.n_action_steps]
            self._action_queue.extend(chunk_BTA.transpose(0, 1))
        return self._action_queue.popleft()

    def _require_keys(self, batch: dict[str, Tensor], need_action: bool) -> None:
        required = list(self.input_features) + (["action"] if need_action else [])
        missing = [key for key in required if key not in batch]
        if missing:
            raise ValueError(f"The {self.name} policy's batch lacks {missing}; it has {sorted(batch)}.")

    def _push_observation(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """`batch` with each input replaced by its history (B, T, ...); at an episode's start the first
        observation fills the history, as a dataset pads frames before the episode with its first frame."""
        stacked = dict(batch)
        for key in self.input_features:
            history = self._observation_history.setdefault(key, deque(maxlen=self._num_history_steps))
            if history:
                history.append(batch[key])
            else:
                history.extend([batch[key]] * self._num_history_steps)
            stacked[key] = torch.stack(list(history), dim=1)
        return stacked

    def reset(self) -> None:
        """Forget queued actions and the observation history (call at the start of every episode)."""
        self._action_queue.clear()
        self._observation_history.clear()

    def config_dict(self) -> dict[str, Any]:
        """config.json's content: LeRobot 0.6.1's fields for this policy type and nothing else (the lerobot_mg-only
        fields live in train_config.json)."""
        return lerobot_config_dict(self.config, self.input_features, self.output_features)

    def write_config(self, directory: Path) -> None:
        """Write config.json alone (sharded checkpoints store weights elsewhere but still need it), as LeRobot
        writes it: ``json.dumps(..., indent=4)``."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / CONFIG_NAME).write_text(json.dumps(self.config_dict(), indent=4))

    def save_pretrained(self, directory: Path, state_dict: dict[str, Tensor] | None = None) -> None:
        """Write config.json and model.safetensors.

        `state_dict` overrides the module's own (e.g. a full state dict gathered from FSDP shards).
        """
        self.write_config(directory)
        tensors = safetensors_ready(self.state_dict() if state_dict is None else state_dict)
        save_file(tensors, str(Path(directory) / WEIGHTS_NAME), metadata={"format": "pt"})

    def load_weights(self, directory: Path, map_location: str | torch.device = "cpu") -> None:
        """Load ``directory``'s model.safetensors into this policy, strictly. The parameters take the dtype the
        weights were stored in (a bf16 base stays bf16: fine-tuning keeps the base's precision)."""
        directory = Path(directory)
        weights_path = directory / WEIGHTS_NAME
        if not weights_path.is_file():
            raise ConfigError(
                f"{directory}: holds no {WEIGHTS_NAME} (a checkpoint saved with checkpoint.format=dcp holds only "
                "DCP shards, pytorch_model_fsdp_0/). Fix: merge them first with lerobot-mg-convert-dcp "
                f"checkpoint_dir={directory}"
            )
        state_dict = load_file(str(weights_path), device=str(map_location))
        stored = {t.dtype for t in state_dict.values() if t.is_floating_point()}
        if len(stored) == 1:
            self.to(stored.pop())
        load_state_dict_strictly(self, state_dict, str(weights_path), str(directory / CONFIG_NAME))

    @classmethod
    def read_config(cls, directory: Path) -> tuple[PolicyConfig, dict[str, FeatureSpec], dict[str, FeatureSpec]]:
        """(config, input_features, output_features) from ``directory``'s config.json (LeRobot's or ours) and the
        lerobot_mg-only fields of its train_config.json, validated (see :func:`read_saved_policy`)."""
        directory = Path(directory)
        saved = read_saved_policy(directory)
        if saved.type != cls.name:
            raise ConfigError(f"{directory / CONFIG_NAME}: holds a policy of type {saved.type!r}, not {cls.name!r}. "
                              f"Fix: policy={saved.type}, or a pretrained_model directory of a {cls.name} policy")
        config = build_config(cls.config_class, {**saved.values, "type": saved.type}, directory / CONFIG_NAME)
        return config, saved.input_features, saved.output_features

    @classmethod
    def from_pretrained(cls, directory: Path, map_location: str | torch.device = "cpu") -> PreTrainedPolicy:
        """Build the policy from config.json and load model.safetensors; returned in eval mode."""
        # The checkpoint holds the backbone's weights: pretrained_backbone_weights is not read (nor downloaded).
        policy = cls(*cls.read_config(directory), load_backbone_weights=False)
        policy.load_weights(directory, map_location)
        policy.to(map_location)
        policy.eval()
        return policy
