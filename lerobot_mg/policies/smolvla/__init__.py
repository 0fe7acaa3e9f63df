from lerobot_mg.config.smolvla import SmolVLAConfig
from lerobot_mg.policies.smolvla.modeling_smolvla import SmolVLAPolicy
from lerobot_mg.policies.smolvla.smolvlm_with_expert import SmolVLAExpertLayer, SmolVLAVLMLayer

__all__ = ["SmolVLAConfig", "SmolVLAExpertLayer", "SmolVLAPolicy", "SmolVLAVLMLayer"]
