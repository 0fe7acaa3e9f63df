"""Config schemas, composition helpers and the config's own consistency checks (no other part of the package)."""

from lerobot_mg.config.schema import TrainConfig, register_configs
from lerobot_mg.config.validate import validate

__all__ = ["TrainConfig", "register_configs", "validate"]
