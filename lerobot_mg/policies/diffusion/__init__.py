from lerobot_mg.config.diffusion import DiffusionConfig
from lerobot_mg.policies.diffusion.modeling_diffusion import DiffusionConditionalUnet1d, DiffusionPolicy

__all__ = ["DiffusionConditionalUnet1d", "DiffusionConfig", "DiffusionPolicy"]
