from lerobot_mg.config.diffusion import DiffusionConfig
from lerobot_mg.policies.diffusion.modeling_diffusion import ConditionalUnet1d, DiffusionPolicy

__all__ = ["ConditionalUnet1d", "DiffusionConfig", "DiffusionPolicy"]
