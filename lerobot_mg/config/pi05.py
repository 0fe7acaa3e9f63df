"""pi0.5's configuration: the Hydra schema of ``policy=pi05``, pi0's fields with LeRobot 0.6.1's ``PI05Config``
defaults (see :mod:`lerobot_mg.config.pi0` for the fields and ``dimension_overrides``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from lerobot_mg.config.choices import NormalizationMode
from lerobot_mg.config.pi0 import PI0Config
from lerobot_mg.config.policy import check_padded_widths


def _pi05_normalization_mapping() -> dict[str, NormalizationMode]:
    # Quantile normalisation (q01..q99 to [-1, 1]) of state and action: the state is then discretised into the prompt.
    return {"VISUAL": NormalizationMode.IDENTITY, "STATE": NormalizationMode.QUANTILES,
            "ACTION": NormalizationMode.QUANTILES}


@dataclass
class PI05Config(PI0Config):
    """pi0.5 (Physical Intelligence 2025): pi0 with the time injected into the expert through adaptive RMSNorm
    (AdaRMS) instead of mixed into the action tokens, the state discretised into the prompt instead of a state
    token, quantile normalisation and longer prompts. LeRobot 0.6.1's fields."""

    policy_class_path: ClassVar[str] = "lerobot_mg.policies.pi05.modeling_pi05:PI05Policy"

    type: str = "pi05"
    normalization_mapping: dict[str, NormalizationMode] = field(default_factory=_pi05_normalization_mapping)
    tokenizer_max_length: int = 200

    def check_features(self, input_features: dict[str, dict], output_features: dict[str, dict]) -> None:
        # The state is never padded (its bins enter the prompt, as in LeRobot): only the action's width is bounded.
        check_padded_widths({"action": ("max_action_dim", self.max_action_dim)}, output_features)
