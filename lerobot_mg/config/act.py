"""ACT's configuration: the policy's hyper-parameters and the Hydra schema of the ``policy=act`` preset."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from lerobot_mg.config.choices import Activation, check_choice
from lerobot_mg.config.policy import PolicyConfig, check_positive_ints
from lerobot_mg.errors import config_error


@dataclass
class ACTConfig(PolicyConfig):
    """Action Chunking Transformer (Zhao et al. 2023), LeRobot-compatible field names. ACT reads the current frame
    only (no observation history)."""

    action_length_key: ClassVar[str] = "chunk_size"

    type: str = "act"
    n_action_steps: int = 100
    chunk_size: int = 100
    dim_model: int = 512
    n_heads: int = 8
    dim_feedforward: int = 3200
    feedforward_activation: Activation = Activation.relu
    n_encoder_layers: int = 4
    # The original ACT code builds 7 decoder layers but only runs the first one; 1 matches its behaviour.
    n_decoder_layers: int = 1
    pre_norm: bool = False
    use_vae: bool = True
    latent_dim: int = 32
    n_vae_encoder_layers: int = 4
    dropout: float = 0.1
    kl_weight: float = 10.0

    @property
    def action_delta_indices(self) -> list[int]:
        """Frame offsets of the action chunk the dataset must load for each sample."""
        return list(range(self.chunk_size))

    def check_fields(self) -> None:
        positive_ints = {
            "chunk_size": self.chunk_size,
            "dim_model": self.dim_model,
            "n_heads": self.n_heads,
            "dim_feedforward": self.dim_feedforward,
            "n_encoder_layers": self.n_encoder_layers,
            "n_decoder_layers": self.n_decoder_layers,
            "latent_dim": self.latent_dim,
        }
        if self.use_vae:
            positive_ints["n_vae_encoder_layers"] = self.n_vae_encoder_layers
        check_positive_ints(positive_ints)
        if self.n_action_steps > self.chunk_size:
            raise config_error(
                "policy.n_action_steps", self.n_action_steps,
                f"exceeds policy.chunk_size={self.chunk_size}: a chunk cannot feed more steps than it holds",
                f"policy.n_action_steps={self.chunk_size}",
            )
        if self.dim_model % self.n_heads != 0:
            heads = next(k for k in range(self.n_heads, 0, -1) if self.dim_model % k == 0)
            raise config_error(
                "policy.dim_model", self.dim_model,
                f"is not divisible by policy.n_heads={self.n_heads} (each head gets dim_model / n_heads features)",
                f"policy.n_heads={heads}",
            )
        check_choice("policy.feedforward_activation", self.feedforward_activation, Activation)
        if not 0.0 <= self.dropout < 1.0:
            raise config_error("policy.dropout", self.dropout, "must be in [0, 1)", "policy.dropout=0.1")
        if self.kl_weight < 0:
            raise config_error("policy.kl_weight", self.kl_weight, "must be >= 0", "policy.kl_weight=10")
