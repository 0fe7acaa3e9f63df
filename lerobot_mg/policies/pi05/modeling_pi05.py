"""pi0.5 (Physical Intelligence 2025, "pi0.5: a Vision-Language-Action Model with Open-World Generalization") as
LeRobot 0.6.1 builds it: pi0's network and passes with three changes.

- The time reaches the expert through adaptive RMSNorm (AdaRMS): a time MLP (``time_mlp_in``, ``time_mlp_out``,
  SiLU after each) turns the sine-cosine time embedding into the condition every expert norm maps (its ``dense``
  layer) to a scale, a shift and a residual gate. The action tokens are ``action_in_proj`` of the noisy actions
  alone.
- The state is not a suffix token: the preprocessor discretises it into the prompt ("Task: ..., State: ...;"), so
  the suffix is the chunk's action tokens only and the policy never reads ``observation.state``.
- Quantile normalisation and 200-token prompts by default (:class:`lerobot_mg.config.pi05.PI05Config`).
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor, nn

from lerobot_mg.config.pi05 import PI05Config
from lerobot_mg.policies.pi0.modeling_pi0 import PI0Policy, PI0Pytorch


class PI05Pytorch(PI0Pytorch):
    """``paligemma_with_expert`` (AdaRMS in the expert), ``action_in_proj``, ``action_out_proj``, ``time_mlp_*``."""

    expert_adarms: ClassVar[bool] = True

    def _build_time_projections(self, width: int) -> None:
        self.time_mlp_in = nn.Linear(width, width)
        self.time_mlp_out = nn.Linear(width, width)

    def embed_suffix(self, state: Tensor | None, noisy_actions: Tensor, timestep: Tensor
                     ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """(action tokens (B, chunk, W), pad masks, autoregressive masks (float), the AdaRMS condition (B, W));
        ``state`` is not read."""
        time_emb = self._time_embedding(timestep)
        action_emb = self.action_in_proj(noisy_actions)
        cond = F.silu(self.time_mlp_out(F.silu(self.time_mlp_in(time_emb))))
        batch_size, chunk = action_emb.shape[:2]
        pad_masks = torch.ones(batch_size, chunk, dtype=torch.bool, device=timestep.device)
        att_masks = self._action_att_masks(batch_size, 0, action_emb.dtype, action_emb.device)
        return action_emb, pad_masks, att_masks, cond


class PI05Policy(PI0Policy):
    """LeRobot's ``PI05Policy``: state dict ``model.paligemma_with_expert.*``, ``model.time_mlp_*``, ..."""

    name: ClassVar[str] = "pi05"
    config_class: ClassVar[type] = PI05Config
    model_class: ClassVar[type[PI0Pytorch]] = PI05Pytorch
    reads_state: ClassVar[bool] = False
