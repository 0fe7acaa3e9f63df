"""The joint layer protocol shared by the VLA policies (pi0, pi0.5, SmolVLA), and the helpers around it.

A VLA runs a vision-language model (VLM) over the prefix (images, language) and an action expert over the suffix
(state, noisy actions); layer i of both attends jointly. FSDP2 must gather and reshard VLM layer i and expert layer
i together (torch's grouped ``fully_shard([vlm_layer_i, expert_layer_i])``: gathered on the group's first forward,
resharded once every module of the group has run its forward). So:

1. VLM layer i and expert layer i are modules whose ``forward`` does the work (their submodules are never called
   from outside), with LeRobot's state-dict names.
2. Joint layer i is computed by calling ``vlm_layer_i(...)``, whose forward calls ``expert_layer_i(...)`` inside
   it: both forwards run in every pass and the outer one finishes last.
3. Every pass calls both: training, the prefix-only pass that fills the key/value cache, each denoising step. An
   absent stream is passed as None and its layer returns None without touching its weights.
4. The policy declares the units with ``fsdp_unit_groups()`` (``[(vlm_layer_i, expert_layer_i), ...]``) and the
   vision tower's layer class in ``_fsdp_wrap_modules``.
5. Activation checkpointing (``policy.gradient_checkpointing``, or ``accelerator.activation_checkpointing``)
   recomputes the VLM layer's forward, which covers the nested expert call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint


@dataclass
class KeyValue:
    """One layer's post-RoPE keys and values (B, kv_heads, T, head_dim): what the prefix-only pass caches for the
    denoising steps."""

    key: Tensor
    value: Tensor


def recompute_in_backward(module: nn.Module) -> None:
    """Replace ``module``'s forward on the instance by a non-reentrant checkpoint of it (the same transform as
    ``accelerator.activation_checkpointing``; names and state dict unchanged). A module already transformed is
    left as it is."""
    if getattr(module, "_recomputed_in_backward", False):
        return
    forward = module.forward

    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = checkpointed  # type: ignore[method-assign]
    module._recomputed_in_backward = True  # type: ignore[assignment]
