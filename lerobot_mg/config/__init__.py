"""Config schemas, composition helpers and validation."""

from lerobot_mg.config.schema import TrainConfig, register_configs
from lerobot_mg.config.validate import config_error, resolve_dp_degrees, validate

__all__ = ["TrainConfig", "config_error", "register_configs", "resolve_dp_degrees", "validate"]
