"""Action Chunking Transformer (Zhao et al. 2023, "Learning Fine-Grained Bimanual Manipulation with
Low-Cost Hardware"), following the structure of LeRobot's ACT.

Token layout of the transformer encoder: [latent, one token per STATE/ENV feature, image feature-map
tokens per camera]. 1-D tokens get learned position embeddings, image tokens a 2-D sinusoidal one. The
decoder runs `chunk_size` learned queries against the encoder output and an action head maps them to a
chunk of actions. With `use_vae`, a separate encoder over [cls, state, action chunk] produces the latent
during training (zeros at inference), regularised by a KL term.

The vision backbone is our own small ResNet (lerobot_mg.policies.vision), trained from scratch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from itertools import chain
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lerobot_mg.config.act import ACTConfig
from lerobot_mg.errors import config_error
from lerobot_mg.policies.base import FeatureSpec, PreTrainedPolicy
from lerobot_mg.policies.vision import VisionBackbone

_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {"relu": F.relu, "gelu": F.gelu}


def sinusoid_1d(positions: Tensor, dim: int) -> Tensor:
    """(N,) positions -> (N, dim) interleaved [sin, cos] embedding with the transformer's 10000 base."""
    num_freqs = (dim + 1) // 2
    exponents = torch.arange(num_freqs, dtype=torch.float64, device=positions.device) * 2 / (2 * num_freqs)
    angles_NF = positions.to(torch.float64)[:, None] / (10000.0**exponents)[None, :]
    embedding = torch.stack([angles_NF.sin(), angles_NF.cos()], dim=-1).flatten(1)[:, :dim]
    return embedding.to(torch.float32)


def sinusoid_2d(height: int, width: int, dim: int, device: torch.device) -> Tensor:
    """(height * width, dim) embedding: first half encodes the row, second half the column (DETR-style,
    positions normalised to (0, 2*pi] so the embedding does not depend on the feature-map size)."""
    dim_y = dim // 2
    dim_x = dim - dim_y
    rows = (torch.arange(height, device=device) + 1) / height * 2 * math.pi
    cols = (torch.arange(width, device=device) + 1) / width * 2 * math.pi
    row_HD = sinusoid_1d(rows, dim_y)
    col_WD = sinusoid_1d(cols, dim_x)
    grid_HWD = torch.cat(
        [row_HD[:, None, :].expand(height, width, dim_y), col_WD[None, :, :].expand(height, width, dim_x)],
        dim=-1,
    )
    return grid_HWD.reshape(height * width, dim)


class ACTEncoderLayer(nn.Module):
    """Self-attention + feed-forward block (post-norm unless `pre_norm`); an FSDP wrap unit."""

    def __init__(self, config: ACTConfig) -> None:
        super().__init__()
        dim = config.dim_model
        self.self_attn = nn.MultiheadAttention(dim, config.n_heads, dropout=config.dropout, batch_first=True)
        self.linear1 = nn.Linear(dim, config.dim_feedforward)
        self.linear2 = nn.Linear(config.dim_feedforward, dim)
        self.norm1 = nn.LayerNorm(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.dropout = nn.Dropout(config.dropout)
        self.dropout1 = nn.Dropout(config.dropout)
        self.dropout2 = nn.Dropout(config.dropout)
        self.activation = _ACTIVATIONS[config.feedforward_activation]
        self.pre_norm = config.pre_norm

    def forward(self, x_BSD: Tensor, pos_BSD: Tensor, key_padding_mask_BS: Tensor | None = None) -> Tensor:
        skip = x_BSD
        x = self.norm1(x_BSD) if self.pre_norm else x_BSD
        query_key = x + pos_BSD
        x = self.self_attn(query_key, query_key, x, key_padding_mask=key_padding_mask_BS, need_weights=False)[
            0
        ]
        x = skip + self.dropout1(x)
        if self.pre_norm:
            skip = x
            x = self.norm2(x)
        else:
            x = self.norm1(x)
            skip = x
        x = self.linear2(self.dropout(self.activation(self.linear1(x))))
        x = skip + self.dropout2(x)
        return x if self.pre_norm else self.norm2(x)


class ACTDecoderLayer(nn.Module):
    """Self-attention over queries, cross-attention to the encoder, feed-forward; an FSDP wrap unit."""

    def __init__(self, config: ACTConfig) -> None:
        super().__init__()
        dim = config.dim_model
        self.self_attn = nn.MultiheadAttention(dim, config.n_heads, dropout=config.dropout, batch_first=True)
        self.cross_attn = nn.MultiheadAttention(dim, config.n_heads, dropout=config.dropout, batch_first=True)
        self.linear1 = nn.Linear(dim, config.dim_feedforward)
        self.linear2 = nn.Linear(config.dim_feedforward, dim)
        self.norm1 = nn.LayerNorm(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.norm3 = nn.LayerNorm(dim)
        self.dropout = nn.Dropout(config.dropout)
        self.dropout1 = nn.Dropout(config.dropout)
        self.dropout2 = nn.Dropout(config.dropout)
        self.dropout3 = nn.Dropout(config.dropout)
        self.activation = _ACTIVATIONS[config.feedforward_activation]
        self.pre_norm = config.pre_norm

    def forward(
        self, x_BTD: Tensor, memory_BSD: Tensor, query_pos_BTD: Tensor, memory_pos_BSD: Tensor
    ) -> Tensor:
        skip = x_BTD
        x = self.norm1(x_BTD) if self.pre_norm else x_BTD
        query_key = x + query_pos_BTD
        x = self.self_attn(query_key, query_key, x, need_weights=False)[0]
        x = skip + self.dropout1(x)
        if self.pre_norm:
            skip = x
            x = self.norm2(x)
        else:
            x = self.norm1(x)
            skip = x
        x = self.cross_attn(x + query_pos_BTD, memory_BSD + memory_pos_BSD, memory_BSD, need_weights=False)[0]
        x = skip + self.dropout2(x)
        if self.pre_norm:
            skip = x
            x = self.norm3(x)
        else:
            x = self.norm2(x)
            skip = x
        x = self.linear2(self.dropout(self.activation(self.linear1(x))))
        x = skip + self.dropout3(x)
        return x if self.pre_norm else self.norm3(x)


class ACTEncoder(nn.Module):
    def __init__(self, config: ACTConfig, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([ACTEncoderLayer(config) for _ in range(num_layers)])
        # Post-norm layers end normalised already; pre-norm stacks need a final norm.
        self.norm: nn.Module = nn.LayerNorm(config.dim_model) if config.pre_norm else nn.Identity()

    def forward(self, x_BSD: Tensor, pos_BSD: Tensor, key_padding_mask_BS: Tensor | None = None) -> Tensor:
        for layer in self.layers:
            x_BSD = layer(x_BSD, pos_BSD, key_padding_mask_BS)
        return self.norm(x_BSD)


class ACTDecoder(nn.Module):
    def __init__(self, config: ACTConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList([ACTDecoderLayer(config) for _ in range(config.n_decoder_layers)])
        self.norm = nn.LayerNorm(config.dim_model)

    def forward(
        self, x_BTD: Tensor, memory_BSD: Tensor, query_pos_BTD: Tensor, memory_pos_BSD: Tensor
    ) -> Tensor:
        for layer in self.layers:
            x_BTD = layer(x_BTD, memory_BSD, query_pos_BTD, memory_pos_BSD)
        return self.norm(x_BTD)


class ACT(nn.Module):
    """The network: batch of normalised features -> action chunk (+ VAE posterior during training)."""

    def __init__(
        self,
        config: ACTConfig,
        input_features: dict[str, FeatureSpec],
        output_features: dict[str, FeatureSpec],
    ) -> None:
        super().__init__()
        self.config = config
        dim = config.dim_model
        for key, spec in input_features.items():
            if spec["type"] in ("STATE", "ENV") and len(spec["shape"]) != 1:
                raise config_error("policy.observation_keys", list(input_features),
                                   f"ACT takes 1-D state features, but {key!r} has shape {list(spec['shape'])}",
                                   f"leave {key!r} out of policy.observation_keys")
        self.state_keys = [key for key, spec in input_features.items() if spec["type"] == "STATE"]
        self.vector_keys = [key for key, spec in input_features.items() if spec["type"] in ("STATE", "ENV")]
        self.image_keys = [key for key, spec in input_features.items() if spec["type"] == "VISUAL"]
        if not self.vector_keys and not self.image_keys:
            raise config_error("policy.observation_keys", list(input_features),
                               f"ACT needs at least one STATE, ENV or VISUAL input; got {input_features}",
                               "policy.observation_keys=[<observation.* features of the dataset>]")
        if "action" not in output_features or len(output_features["action"]["shape"]) != 1:
            raise config_error("output_features", output_features, "ACT needs a 1-D 'action' output feature",
                               "a dataset (dataset.root) whose 'action' feature is 1-D")
        action_dim = int(output_features["action"]["shape"][0])

        if config.use_vae:
            self.vae_encoder = ACTEncoder(config, config.n_vae_encoder_layers)
            self.vae_cls_embed = nn.Embedding(1, dim)
            self.vae_state_projs = nn.ModuleList(
                [nn.Linear(int(input_features[key]["shape"][0]), dim) for key in self.state_keys]
            )
            self.vae_action_proj = nn.Linear(action_dim, dim)
            # Outputs mu and log(sigma^2) of the latent posterior.
            self.vae_latent_out_proj = nn.Linear(dim, 2 * config.latent_dim)

        self.latent_proj = nn.Linear(config.latent_dim, dim)
        self.vector_projs = nn.ModuleList(
            [nn.Linear(int(input_features[key]["shape"][0]), dim) for key in self.vector_keys]
        )
        self.token_pos_embed = nn.Embedding(1 + len(self.vector_keys), dim)
        if self.image_keys:
            num_channels = {int(input_features[key]["shape"][0]) for key in self.image_keys}
            if len(num_channels) != 1:
                raise config_error(
                    "policy.observation_keys", list(input_features),
                    "ACT shares one vision backbone across cameras, so all images need the same channel count; "
                    f"got { {key: input_features[key]['shape'] for key in self.image_keys} }",
                    "leave the cameras with another channel count out of policy.observation_keys",
                )
            self.backbone = VisionBackbone(num_channels.pop(), list(config.vision_channels))
            self.image_proj = nn.Conv2d(self.backbone.num_out_channels, dim, kernel_size=1)

        self.encoder = ACTEncoder(config, config.n_encoder_layers)
        self.decoder = ACTDecoder(config)
        self.decoder_queries = nn.Embedding(config.chunk_size, dim)
        self.action_head = nn.Linear(dim, action_dim)

        # Xavier on the transformer matrices, as the original ACT (inherited from DETR).
        for param in chain(self.encoder.parameters(), self.decoder.parameters()):
            if param.dim() > 1:
                nn.init.xavier_uniform_(param)

    def _encode_latent(
        self, batch: dict[str, Tensor], batch_size: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Latent (B, latent_dim) and the posterior (mu, log_sigma_x2), or zeros and None at inference."""
        if not (self.config.use_vae and self.training and "action" in batch):
            latent = torch.zeros(batch_size, self.config.latent_dim, dtype=dtype, device=device)
            return latent, None, None
        actions_BTA = batch["action"].to(dtype)
        cls_B1D = self.vae_cls_embed.weight[None].expand(batch_size, -1, -1)
        state_tokens = [
            proj(batch[key].to(dtype))[:, None] for proj, key in zip(self.vae_state_projs, self.state_keys)
        ]
        tokens_BSD = torch.cat([cls_B1D, *state_tokens, self.vae_action_proj(actions_BTA)], dim=1)
        positions = torch.arange(tokens_BSD.shape[1], device=tokens_BSD.device)
        pos_1SD = sinusoid_1d(positions, self.config.dim_model)[None].to(dtype)
        num_unpadded = 1 + len(state_tokens)
        action_is_pad_BT = batch.get("action_is_pad")
        if action_is_pad_BT is None:
            action_is_pad_BT = torch.zeros(actions_BTA.shape[:2], dtype=torch.bool, device=actions_BTA.device)
        key_padding_mask_BS = torch.cat(
            [
                torch.zeros(batch_size, num_unpadded, dtype=torch.bool, device=actions_BTA.device),
                action_is_pad_BT,
            ],
            dim=1,
        )
        cls_out_BD = self.vae_encoder(tokens_BSD, pos_1SD, key_padding_mask_BS)[:, 0]
        latent_params = self.vae_latent_out_proj(cls_out_BD)
        mu = latent_params[:, : self.config.latent_dim]
        log_sigma_x2 = latent_params[:, self.config.latent_dim :]
        latent = mu + (log_sigma_x2 / 2).exp() * torch.randn_like(mu)
        return latent, mu, log_sigma_x2

    def forward(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Returns (actions (B, chunk_size, action_dim), mu, log_sigma_x2); the last two are None unless
        the VAE encoded the batch's action chunk (training with use_vae)."""
        # Under FSDP mixed precision the parameters are already in the compute dtype here; match it.
        dtype = self.action_head.weight.dtype
        first_key = (self.vector_keys + self.image_keys)[0]
        batch_size = batch[first_key].shape[0]
        latent, mu, log_sigma_x2 = self._encode_latent(batch, batch_size, dtype, batch[first_key].device)

        vector_tokens = [self.latent_proj(latent)]
        vector_tokens += [
            proj(batch[key].to(dtype)) for proj, key in zip(self.vector_projs, self.vector_keys)
        ]
        tokens = [torch.stack(vector_tokens, dim=1)]
        positions = [self.token_pos_embed.weight[None]]
        for key in self.image_keys:
            feature_map_BDHW = self.image_proj(self.backbone(batch[key].to(dtype)))
            height, width = feature_map_BDHW.shape[-2:]
            tokens.append(feature_map_BDHW.flatten(2).transpose(1, 2))
            positions.append(
                sinusoid_2d(height, width, self.config.dim_model, feature_map_BDHW.device)[None].to(dtype)
            )
        tokens_BSD = torch.cat(tokens, dim=1)
        pos_1SD = torch.cat(positions, dim=1)
        memory_BSD = self.encoder(tokens_BSD, pos_1SD)

        query_pos_1TD = self.decoder_queries.weight[None]
        # As in DETR/ACT the decoder input is zero: the queries enter only as position embeddings.
        decoder_in_BTD = torch.zeros(
            batch_size, self.config.chunk_size, self.config.dim_model, dtype=dtype, device=memory_BSD.device
        )
        decoded_BTD = self.decoder(decoder_in_BTD, memory_BSD, query_pos_1TD, pos_1SD)
        return self.action_head(decoded_BTD), mu, log_sigma_x2


class ACTPolicy(PreTrainedPolicy):
    name: ClassVar[str] = "act"
    config_class: ClassVar[type] = ACTConfig
    _fsdp_wrap_modules: ClassVar[list[str]] = ["ACTEncoderLayer", "ACTDecoderLayer"]
    # The feed-forward projections of every encoder/decoder layer. The attention is nn.MultiheadAttention: peft's
    # LoRA wrapper for it swaps parameters during forward, which FSDP2 cannot shard, and its out_proj is read as
    # a weight, never called, so an adapter there would silently do nothing.
    _peft_target_modules: ClassVar[list[str]] = ["linear1", "linear2"]

    def __init__(
        self,
        config: ACTConfig,
        input_features: dict[str, FeatureSpec],
        output_features: dict[str, FeatureSpec],
    ) -> None:
        super().__init__(config, input_features, output_features)
        self.config: ACTConfig = config
        self.model = ACT(config, self.input_features, self.output_features)

    def _check_inputs(self, batch: dict[str, Tensor], need_action: bool) -> None:
        self._require_keys(batch, need_action)
        if need_action and batch["action"].shape[1] != self.config.chunk_size:
            raise ValueError(
                f"The batch's action chunk has {batch['action'].shape[1]} steps but "
                f"policy.chunk_size={self.config.chunk_size}; load action chunks of chunk_size frames."
            )

    def forward(self, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """L1 over action positions (padded ones count as zero error) + kl_weight * KL (when the VAE ran). The
        logged parts are detached tensors on the loss's device: reading them would wait for the device."""
        self._check_inputs(batch, need_action=True)
        actions_hat_BTA, mu, log_sigma_x2 = self.model(batch)
        target_BTA = batch["action"]
        action_is_pad_BT = batch.get("action_is_pad")
        if action_is_pad_BT is None:
            action_is_pad_BT = torch.zeros(target_BTA.shape[:2], dtype=torch.bool, device=target_BTA.device)
        valid_BT1 = ~action_is_pad_BT[..., None]
        # where() rather than a multiply so that NaN targets at padded positions cannot leak into the loss.
        abs_error_BTA = torch.where(valid_BT1, (actions_hat_BTA.float() - target_BTA.float()).abs(), 0.0)
        # Mean over every position, padded ones counting as zero error (as LeRobot's ACT does): each sample weighs
        # the same whatever its padding, so the mean over data-parallel ranks of per-rank losses equals the loss of
        # one process on the whole global batch. A mean over valid positions only would not (per-rank
        # denominators differ) and DDP/FSDP would drift from a single-process run on padded chunks.
        l1_loss = abs_error_BTA.mean()
        if mu is not None and log_sigma_x2 is not None:
            mu, log_sigma_x2 = mu.float(), log_sigma_x2.float()
            # KL(N(mu, sigma) || N(0, 1)) summed over latent dims, averaged over the batch.
            kld_loss = (-0.5 * (1 + log_sigma_x2 - mu.pow(2) - log_sigma_x2.exp())).sum(-1).mean()
            loss = l1_loss + self.config.kl_weight * kld_loss
            kld_value = kld_loss.detach()
        else:
            loss = l1_loss
            kld_value = torch.zeros((), device=l1_loss.device)
        return loss, {"l1_loss": l1_loss.detach(), "kld_loss": kld_value}

    @torch.no_grad()
    def predict_action_chunk(self, batch: dict[str, Tensor]) -> Tensor:
        self._check_inputs(batch, need_action=False)
        return self.model(batch)[0]
