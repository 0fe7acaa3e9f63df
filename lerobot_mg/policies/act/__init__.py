from lerobot_mg.config.act import ACTConfig
from lerobot_mg.policies.act.modeling_act import ACT, ACTDecoderLayer, ACTEncoderLayer, ACTPolicy

__all__ = ["ACT", "ACTConfig", "ACTDecoderLayer", "ACTEncoderLayer", "ACTPolicy"]
