"""The steps every LeRobot 0.6.1 policy pipeline has besides (un)normalisation, under LeRobot's names.

ACT and Diffusion: preprocessor ``rename_observations_processor`` -> ``to_batch_processor`` -> ``device_processor`` ->
``normalizer_processor``; postprocessor ``unnormalizer_processor`` -> ``device_processor`` (to the CPU). The
vision-language-action policies add their language steps between them (:mod:`lerobot_mg.processors.vla`).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from lerobot_mg.errors import ConfigError
from lerobot_mg.processors.pipeline import ProcessorStep, register_step

# LeRobot's names of the float dtypes a device_processor may cast to.
FLOAT_DTYPES = {
    "float16": torch.float16, "half": torch.float16, "float32": torch.float32, "float": torch.float32,
    "float64": torch.float64, "double": torch.float64, "bfloat16": torch.bfloat16,
}
_STATE_KEYS = ("observation.state", "observation.environment_state")


@register_step
class RenameObservationsStep(ProcessorStep):
    """Renames observation keys (``rename_map``: old -> new); empty by default."""

    registry_name: ClassVar[str] = "rename_observations_processor"

    def __init__(self, rename_map: dict[str, str] | None = None) -> None:
        self.rename_map = dict(rename_map or {})

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        if not self.rename_map:
            return batch
        return {self.rename_map.get(key, key) if key.startswith("observation.") else key: value
                for key, value in batch.items()}

    def get_config(self) -> dict[str, Any]:
        return {"rename_map": self.rename_map}

    @classmethod
    def from_config(cls, config: dict[str, Any], state: dict[str, Tensor]) -> RenameObservationsStep:
        return cls(config.get("rename_map"))


@register_step
class ToBatchStep(ProcessorStep):
    """Adds the batch dimension to one unbatched sample, as LeRobot does: a 1-D state or action, a 3-D image, a
    0-D ``index`` / ``task_index``, a ``task`` string. Batched inputs pass unchanged."""

    registry_name: ClassVar[str] = "to_batch_processor"

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        out = dict(batch)
        for key, value in batch.items():
            if not isinstance(value, Tensor):
                if key == "task" and isinstance(value, str):
                    out[key] = [value]
                continue
            is_image = key == "observation.image" or key.startswith("observation.images.")
            unbatched = ((key in _STATE_KEYS or key == "action") and value.dim() == 1
                         or is_image and value.dim() == 3
                         or key in ("index", "task_index") and value.dim() == 0)
            if unbatched:
                out[key] = value.unsqueeze(0)
        return out

    def get_config(self) -> dict[str, Any]:
        return {}

    @classmethod
    def from_config(cls, config: dict[str, Any], state: dict[str, Tensor]) -> ToBatchStep:
        return cls()


@register_step
class DeviceStep(ProcessorStep):
    """Moves the policy's tensors (``observation.*`` and ``action*``: inputs, targets, padding masks) to ``device``,
    floating ones cast to ``float_dtype`` when set; the rest of the batch (indices, the per-sample seeds the policies
    read on the host) stays where it is. The pipeline's ``to(device)`` retargets it; the file records the device type
    (``cuda``, not ``cuda:1``), as LeRobot's does."""

    registry_name: ClassVar[str] = "device_processor"

    def __init__(self, device: torch.device | str = "cpu", float_dtype: str | None = None) -> None:
        if float_dtype is not None and float_dtype not in FLOAT_DTYPES:
            raise ConfigError(f"device_processor.float_dtype={float_dtype!r}: is not a float dtype LeRobot names. "
                              f"Fix: one of {sorted(FLOAT_DTYPES)}, or null")
        self.device = torch.device(device)
        self.float_dtype = float_dtype

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        dtype = FLOAT_DTYPES[self.float_dtype] if self.float_dtype is not None else None
        out = dict(batch)
        for key, value in batch.items():
            if isinstance(value, Tensor) and key.startswith(("observation.", "action")):
                value = value.to(self.device, non_blocking=self.device.type == "cuda")
                out[key] = value.to(dtype) if dtype is not None and value.is_floating_point() else value
        return out

    def to(self, device: torch.device | str) -> DeviceStep:
        self.device = torch.device(device)
        return self

    def get_config(self) -> dict[str, Any]:
        return {"device": self.device.type, "float_dtype": self.float_dtype}

    @classmethod
    def from_config(cls, config: dict[str, Any], state: dict[str, Tensor]) -> DeviceStep:
        return cls(config.get("device", "cpu"), config.get("float_dtype"))
