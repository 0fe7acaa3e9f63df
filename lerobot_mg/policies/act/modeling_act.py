"""Action Chunking Transformer (Zhao et al. 2023, "Learning Fine-Grained Bimanual Manipulation with
Low-Cost Hardware"), as LeRobot 0.6.1 builds it: the same modules under the same state_dict names, shapes and
buffers, and the same numbers, so LeRobot's ACT checkpoints load here and ours load in LeRobot.

Token layout of the transformer encoder, sequence first (S, B, D): [latent, robot state, env state, then each
camera's feature map as (h w) tokens]. 1-D tokens get learned position embeddings, camera tokens a 2-D sinusoidal
one. The decoder runs ``chunk_size`` learned position queries against the encoder output and an action head maps
them to a chunk of actions. With ``use_vae``, a separate encoder over [cls, robot state, action chunk] gives the
latent during training (zeros otherwise), regularised by a KL term.

Camera backbone (``vision_backbone``): torchvision's ResNet18 with frozen batch norm (LeRobot's), or our small CNN
(``lerobot_mg_cnn``). Images arrive normalised by the preprocessor (ImageNet statistics for a pretrained ResNet).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from itertools import chain
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lerobot_mg.config.act import TORCHVISION_RESNET18_WEIGHTS, ACTConfig
from lerobot_mg.config.choices import L1Reduction
from lerobot_mg.config.choices import VisionBackbone as BackboneName
from lerobot_mg.errors import config_error
from lerobot_mg.policies.base import FeatureSpec, PreTrainedPolicy
from lerobot_mg.policies.vision import ResNet18FeatureMap, ResNetNorm, VisionBackbone, load_resnet18_weights

_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {"relu": F.relu, "gelu": F.gelu}
ROBOT_STATE_KEY = "observation.state"
ENV_STATE_KEY = "observation.environment_state"


def create_sinusoidal_pos_embedding(num_positions: int, dimension: int) -> Tensor:
    """(num_positions, dimension) table of the transformer's 1-D sinusoid: position / 10000^(2 (j // 2) / d), sin
    on even j, cos on odd j; computed in float64 (numpy), returned float32, as LeRobot's VAE encoder buffer."""
    exponents = 2 * (np.arange(dimension) // 2) / dimension
    table = np.arange(num_positions, dtype=np.float64)[:, None] / np.power(10000, exponents)[None, :]
    table[:, 0::2] = np.sin(table[:, 0::2])
    table[:, 1::2] = np.cos(table[:, 1::2])
    return torch.tensor(table, dtype=torch.float32)  # on the default device (meta for a skeleton build)


def sinusoid_2d(height: int, width: int, dimension: int, device: torch.device) -> Tensor:
    """(height * width, 1, 2 * dimension) DETR-style embedding of a feature map's pixels, (h w) order: ``dimension``
    interleaved sin/cos features of the row, then as many of the column, positions 1..H and 1..W scaled to
    (0, 2 pi] (LeRobot's ACTSinusoidalPositionEmbedding2d, float32, the same eps)."""
    ones = torch.ones(1, height, width, device=device)
    y_range = ones.cumsum(1, dtype=torch.float32)
    x_range = ones.cumsum(2, dtype=torch.float32)
    y_range = y_range / (y_range[:, -1:, :] + 1e-6) * (2 * math.pi)
    x_range = x_range / (x_range[:, :, -1:] + 1e-6) * (2 * math.pi)
    inverse_frequency = 10000 ** (
        2 * (torch.arange(dimension, dtype=torch.float32, device=device) // 2) / dimension
    )
    x_range = x_range.unsqueeze(-1) / inverse_frequency
    y_range = y_range.unsqueeze(-1) / inverse_frequency
    pos_x = torch.stack((x_range[..., 0::2].sin(), x_range[..., 1::2].cos()), dim=-1).flatten(3)
    pos_y = torch.stack((y_range[..., 0::2].sin(), y_range[..., 1::2].cos()), dim=-1).flatten(3)
    return torch.cat((pos_y, pos_x), dim=3).reshape(height * width, 1, 2 * dimension)


class ACTDropout(nn.Dropout):
    """nn.Dropout drawing its mask with ``rand_like`` (uniform floats, then a compare) instead of ``bernoulli_``:
    the same distribution, and on a CPU ten times cheaper to draw."""

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        return x * _dropout_mask(x, self.p)


def _dropout_mask(x: Tensor, p: float) -> Tensor:
    return (torch.rand_like(x) >= p).to(x.dtype).mul_(1.0 / (1.0 - p))


def attention(module: nn.MultiheadAttention, query: Tensor, key: Tensor, value: Tensor,
              key_padding_mask: Tensor | None = None) -> Tensor:
    """``module(query, key, value, key_padding_mask)[0]`` for (L, B, D) inputs, the same operations in the same
    order as torch's need_weights path (LeRobot's numbers bit for bit), without averaging the attention weights
    nobody reads, and with :class:`ACTDropout`'s mask on them in training."""
    tgt_len, batch_size, embed_dim = query.shape
    num_heads = module.num_heads
    head_dim = embed_dim // num_heads
    w_q, w_k, w_v = module.in_proj_weight.chunk(3)
    b_q, b_k, b_v = module.in_proj_bias.chunk(3)
    q = F.linear(query, w_q, b_q).view(tgt_len, batch_size * num_heads, head_dim).transpose(0, 1)
    k = F.linear(key, w_k, b_k).view(key.shape[0], batch_size * num_heads, head_dim).transpose(0, 1)
    v = F.linear(value, w_v, b_v).view(value.shape[0], batch_size * num_heads, head_dim).transpose(0, 1)
    q_scaled = q * math.sqrt(1.0 / float(head_dim))
    if key_padding_mask is None:
        weights = torch.bmm(q_scaled, k.transpose(-2, -1))
    else:
        mask = torch.zeros_like(key_padding_mask, dtype=q.dtype).masked_fill_(key_padding_mask, float("-inf"))
        mask = mask.view(batch_size, 1, 1, -1).expand(-1, num_heads, -1, -1).reshape(batch_size * num_heads, 1, -1)
        weights = torch.baddbmm(mask, q_scaled, k.transpose(-2, -1))
    weights = F.softmax(weights, dim=-1)
    if module.training and module.dropout > 0.0:
        weights = weights * _dropout_mask(weights, module.dropout)
    out = torch.bmm(weights, v).transpose(0, 1).contiguous().view(tgt_len * batch_size, embed_dim)
    return F.linear(out, module.out_proj.weight, module.out_proj.bias).view(tgt_len, batch_size, embed_dim)


class ACTMultiheadAttention(nn.MultiheadAttention):
    """nn.MultiheadAttention (same parameters and state_dict names) whose call runs :func:`attention` and returns
    the output alone. Called as a module, so that FSDP's hooks gather its parameters when it is a wrap unit of its
    own (wrapping by size may pick it)."""

    def forward(self, query: Tensor, key: Tensor, value: Tensor,  # type: ignore[override]
                key_padding_mask: Tensor | None = None) -> Tensor:
        return attention(self, query, key, value, key_padding_mask)


class ACTEncoderLayer(nn.Module):
    """Self-attention + feed-forward block (post-norm unless ``pre_norm``), sequence first; an FSDP wrap unit."""

    def __init__(self, config: ACTConfig) -> None:
        super().__init__()
        dim = config.dim_model
        self.self_attn = ACTMultiheadAttention(dim, config.n_heads, dropout=config.dropout)
        self.linear1 = nn.Linear(dim, config.dim_feedforward)
        self.dropout = ACTDropout(config.dropout)
        self.linear2 = nn.Linear(config.dim_feedforward, dim)
        self.norm1 = nn.LayerNorm(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.dropout1 = ACTDropout(config.dropout)
        self.dropout2 = ACTDropout(config.dropout)
        self.activation = _ACTIVATIONS[config.feedforward_activation]
        self.pre_norm = config.pre_norm

    def forward(self, x_SBD: Tensor, pos_embed: Tensor | None = None, key_padding_mask_BS: Tensor | None = None,
                first_token_only: bool = False) -> Tensor:
        """(S, B, D) -> (S, B, D); ``first_token_only``: (1, B, D), the first token's output alone (every token
        still attends to all, but only the first one's attention and feed-forward are computed)."""
        x = self.norm1(x_SBD) if self.pre_norm else x_SBD
        query_key = x if pos_embed is None else x + pos_embed
        query, skip = (query_key[:1], x_SBD[:1]) if first_token_only else (query_key, x_SBD)
        x = self.self_attn(query, query_key, x, key_padding_mask_BS)
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
    """Self-attention over the queries, cross-attention (``multihead_attn``) to the encoder, feed-forward; an FSDP
    wrap unit."""

    def __init__(self, config: ACTConfig) -> None:
        super().__init__()
        dim = config.dim_model
        self.self_attn = ACTMultiheadAttention(dim, config.n_heads, dropout=config.dropout)
        self.multihead_attn = ACTMultiheadAttention(dim, config.n_heads, dropout=config.dropout)
        self.linear1 = nn.Linear(dim, config.dim_feedforward)
        self.dropout = ACTDropout(config.dropout)
        self.linear2 = nn.Linear(config.dim_feedforward, dim)
        self.norm1 = nn.LayerNorm(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.norm3 = nn.LayerNorm(dim)
        self.dropout1 = ACTDropout(config.dropout)
        self.dropout2 = ACTDropout(config.dropout)
        self.dropout3 = ACTDropout(config.dropout)
        self.activation = _ACTIVATIONS[config.feedforward_activation]
        self.pre_norm = config.pre_norm

    def forward(self, x_TBD: Tensor, encoder_out_SBD: Tensor, decoder_pos_embed: Tensor,
                encoder_pos_embed: Tensor) -> Tensor:
        skip = x_TBD
        x = self.norm1(x_TBD) if self.pre_norm else x_TBD
        query_key = x + decoder_pos_embed
        x = self.self_attn(query_key, query_key, x)
        x = skip + self.dropout1(x)
        if self.pre_norm:
            skip = x
            x = self.norm2(x)
        else:
            x = self.norm1(x)
            skip = x
        x = self.multihead_attn(x + decoder_pos_embed, encoder_out_SBD + encoder_pos_embed, encoder_out_SBD)
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
    def __init__(self, config: ACTConfig, is_vae_encoder: bool = False) -> None:
        super().__init__()
        num_layers = config.n_vae_encoder_layers if is_vae_encoder else config.n_encoder_layers
        self.layers = nn.ModuleList([ACTEncoderLayer(config) for _ in range(num_layers)])
        # Post-norm layers end normalised already; pre-norm stacks need a final norm.
        self.norm: nn.Module = nn.LayerNorm(config.dim_model) if config.pre_norm else nn.Identity()

    def forward(self, x_SBD: Tensor, pos_embed: Tensor | None = None, key_padding_mask: Tensor | None = None,
                first_token_only: bool = False) -> Tensor:
        """``first_token_only``: the last layer computes the first token's output alone (the VAE encoder reads
        only its cls token), (1, B, D)."""
        for index, layer in enumerate(self.layers):
            last = index == len(self.layers) - 1
            x_SBD = layer(x_SBD, pos_embed, key_padding_mask, first_token_only and last)
        return self.norm(x_SBD)


class ACTDecoder(nn.Module):
    def __init__(self, config: ACTConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList([ACTDecoderLayer(config) for _ in range(config.n_decoder_layers)])
        self.norm = nn.LayerNorm(config.dim_model)

    def forward(self, x_TBD: Tensor, encoder_out_SBD: Tensor, decoder_pos_embed: Tensor,
                encoder_pos_embed: Tensor) -> Tensor:
        for layer in self.layers:
            x_TBD = layer(x_TBD, encoder_out_SBD, decoder_pos_embed, encoder_pos_embed)
        return self.norm(x_TBD)


def _pretrained_resnet18_weights(source: str) -> dict[str, Tensor]:
    """torchvision's ImageNet ResNet18 weights from a local file, or by torchvision's weight name."""
    key = "policy.pretrained_backbone_weights"
    if Path(source).is_file():
        return load_resnet18_weights(Path(source))
    if not source.startswith("ResNet18_Weights."):
        raise config_error(key, source, "is neither a file nor torchvision's name of ResNet18 weights",
                           f"{key}=<path to resnet18-f37072fd.pth>, {key}={TORCHVISION_RESNET18_WEIGHTS} "
                           "(needs torchvision) or null")
    try:
        # Optional: torchvision is not a dependency (its wheels are CUDA-linked); where a user has it installed,
        # its weight names work as in LeRobot (downloaded into torch's hub cache).
        from torchvision.models import get_weight
    except (ImportError, OSError, RuntimeError) as error:
        raise config_error(key, source, f"is a torchvision weight name, and torchvision cannot be imported ({error})",
                           f"{key}=<local copy of torchvision's resnet18-f37072fd.pth>, or null") from error
    state_dict = get_weight(source).get_state_dict(progress=False)
    return {name: value for name, value in state_dict.items() if not name.startswith("fc.")}


class ACT(nn.Module):
    """The network: batch of normalised features -> (action chunk, (mu, log_sigma_x2)); the posterior's two are
    None unless the VAE encoded the batch's action chunk (training with use_vae)."""

    def __init__(self, config: ACTConfig, input_features: dict[str, FeatureSpec],
                 output_features: dict[str, FeatureSpec], load_backbone_weights: bool = True) -> None:
        super().__init__()
        self.config = config
        dim = config.dim_model
        self._check_features(input_features, output_features)
        self.has_robot_state = ROBOT_STATE_KEY in input_features
        self.has_env_state = ENV_STATE_KEY in input_features
        self.image_keys = [key for key, spec in input_features.items() if spec["type"] == "VISUAL"]
        action_dim = int(output_features["action"]["shape"][0])

        if config.use_vae:
            self.vae_encoder = ACTEncoder(config, is_vae_encoder=True)
            self.vae_encoder_cls_embed = nn.Embedding(1, dim)
            if self.has_robot_state:
                state_dim = int(input_features[ROBOT_STATE_KEY]["shape"][0])
                self.vae_encoder_robot_state_input_proj = nn.Linear(state_dim, dim)
            self.vae_encoder_action_input_proj = nn.Linear(action_dim, dim)
            # Outputs mu and log(sigma^2) of the latent posterior.
            self.vae_encoder_latent_output_proj = nn.Linear(dim, 2 * config.latent_dim)
            num_vae_tokens = 1 + config.chunk_size + int(self.has_robot_state)
            self.register_buffer("vae_encoder_pos_enc",
                                 create_sinusoidal_pos_embedding(num_vae_tokens, dim).unsqueeze(0))

        if self.image_keys:
            self.backbone = self._build_backbone(input_features, load_backbone_weights)

        self.encoder = ACTEncoder(config)
        self.decoder = ACTDecoder(config)
        if self.has_robot_state:
            self.encoder_robot_state_input_proj = nn.Linear(int(input_features[ROBOT_STATE_KEY]["shape"][0]), dim)
        if self.has_env_state:
            self.encoder_env_state_input_proj = nn.Linear(int(input_features[ENV_STATE_KEY]["shape"][0]), dim)
        self.encoder_latent_input_proj = nn.Linear(config.latent_dim, dim)
        if self.image_keys:
            self.encoder_img_feat_input_proj = nn.Conv2d(self.backbone.num_out_channels, dim, kernel_size=1)
        num_1d_tokens = 1 + int(self.has_robot_state) + int(self.has_env_state)
        self.encoder_1d_feature_pos_embed = nn.Embedding(num_1d_tokens, dim)
        # Learned positions of the decoder's queries (DETR's object queries).
        self.decoder_pos_embed = nn.Embedding(config.chunk_size, dim)
        self.action_head = nn.Linear(dim, action_dim)

        # Xavier on the transformer matrices, as the original ACT (inherited from DETR).
        for param in chain(self.encoder.parameters(), self.decoder.parameters()):
            if param.dim() > 1:
                nn.init.xavier_uniform_(param)

    def _check_features(self, input_features: dict[str, FeatureSpec],
                        output_features: dict[str, FeatureSpec]) -> None:
        vectors = {key: spec for key, spec in input_features.items() if spec["type"] in ("STATE", "ENV")}
        others = [key for key in vectors if key not in (ROBOT_STATE_KEY, ENV_STATE_KEY)]
        bad_shape = [key for key, spec in vectors.items() if len(spec["shape"]) != 1]
        if others or bad_shape:
            keep = [key for key in input_features if key not in others + bad_shape]
            raise config_error(
                "policy.observation_keys", list(input_features),
                f"ACT (as LeRobot's) takes one 1-D {ROBOT_STATE_KEY}, one 1-D {ENV_STATE_KEY} and cameras; "
                f"{others + bad_shape} cannot be an input",
                f"policy.observation_keys=[{','.join(keep)}]",
            )
        if not input_features:
            raise config_error("policy.observation_keys", list(input_features),
                               "ACT needs at least one state, environment state or camera input",
                               f"policy.observation_keys=[{ROBOT_STATE_KEY}]")
        if "action" not in output_features or len(output_features["action"]["shape"]) != 1:
            raise config_error("output_features", output_features, "ACT needs a 1-D 'action' output feature",
                               "a dataset (dataset.root) whose 'action' feature is 1-D")

    def _build_backbone(self, input_features: dict[str, FeatureSpec], load_weights: bool) -> nn.Module:
        config = self.config
        shapes = {key: list(input_features[key]["shape"]) for key in self.image_keys}
        num_channels = {shape[0] for shape in shapes.values()}
        if len(num_channels) != 1:
            raise config_error(
                "policy.observation_keys", list(input_features),
                f"ACT shares one vision backbone across cameras, so all need the same channel count; got {shapes}",
                "leave the cameras with another channel count out of policy.observation_keys",
            )
        if config.dim_model % 2:
            raise config_error("policy.dim_model", config.dim_model,
                               "must be even with cameras (half of each camera token's position embedding "
                               "encodes the row, half the column)", f"policy.dim_model={config.dim_model + 1}")
        in_channels = num_channels.pop()
        if config.vision_backbone == BackboneName.lerobot_mg_cnn:
            return VisionBackbone(in_channels, list(config.vision_channels))
        if config.replace_final_stride_with_dilation:
            raise config_error(
                "policy.replace_final_stride_with_dilation", True,
                "ResNet18's basic blocks cannot dilate (torchvision refuses it, so LeRobot cannot build it either)",
                "policy.replace_final_stride_with_dilation=false",
            )
        backbone = ResNet18FeatureMap(ResNetNorm.FROZEN_BATCH_NORM, in_channels)
        if load_weights and config.pretrained_backbone_weights is not None:
            weights = _pretrained_resnet18_weights(config.pretrained_backbone_weights)
            try:
                backbone.load_state_dict(weights, strict=True)
            except RuntimeError as error:
                raise config_error(
                    "policy.pretrained_backbone_weights", config.pretrained_backbone_weights,
                    f"do not fit ResNet18 with {in_channels}-channel cameras: {' '.join(str(error).split())}",
                    "torchvision's ImageNet ResNet18 weights (resnet18-f37072fd.pth) and 3-channel cameras, or null",
                ) from error
        return backbone

    def _latent(self, batch: dict[str, Tensor], batch_size: int, dtype: torch.dtype,
                device: torch.device) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Latent (B, latent_dim) and the posterior (mu, log_sigma_x2), or zeros and None outside training."""
        config = self.config
        if not (config.use_vae and self.training and "action" in batch):
            return torch.zeros(batch_size, config.latent_dim, dtype=dtype, device=device), None, None
        actions_BTD = self.vae_encoder_action_input_proj(batch["action"].to(dtype))
        tokens = [self.vae_encoder_cls_embed.weight[None].expand(batch_size, -1, -1)]
        if self.has_robot_state:
            tokens.append(self.vae_encoder_robot_state_input_proj(batch[ROBOT_STATE_KEY].to(dtype))[:, None])
        tokens_SBD = torch.cat([*tokens, actions_BTD], dim=1).transpose(0, 1)
        pos_embed_S1D = self.vae_encoder_pos_enc.to(dtype).transpose(0, 1)
        action_is_pad_BT = batch.get("action_is_pad")
        if action_is_pad_BT is None:
            action_is_pad_BT = torch.zeros(actions_BTD.shape[:2], dtype=torch.bool, device=device)
        # False: a real token. The cls and robot-state tokens never are padding.
        key_padding_mask_BS = torch.cat(
            [torch.zeros(batch_size, len(tokens), dtype=torch.bool, device=device), action_is_pad_BT], dim=1
        )
        cls_out_BD = self.vae_encoder(tokens_SBD, pos_embed_S1D, key_padding_mask_BS, first_token_only=True)[0]
        latent_params = self.vae_encoder_latent_output_proj(cls_out_BD)
        mu = latent_params[:, : config.latent_dim]
        log_sigma_x2 = latent_params[:, config.latent_dim :]  # 2 log(sigma), as the original code
        return mu + log_sigma_x2.div(2).exp() * torch.randn_like(mu), mu, log_sigma_x2

    def _camera_tokens(self, batch: dict[str, Tensor], dtype: torch.dtype) -> tuple[list[Tensor], list[Tensor]]:
        """Per camera, (h w, B, D) tokens and their (h w, 1, D) position embedding. Cameras of one size go through
        the backbone together (its frozen batch norm keeps no batch statistics, so this changes nothing)."""
        images = [batch[key].to(dtype) for key in self.image_keys]
        same_size = len({image.shape for image in images}) == 1
        feature_maps = self.backbone(torch.cat(images)).split(images[0].shape[0]) if same_size else [
            self.backbone(image) for image in images
        ]
        tokens, positions = [], []
        for feature_map_BCHW in feature_maps:
            height, width = feature_map_BCHW.shape[-2:]
            positions.append(sinusoid_2d(height, width, self.config.dim_model // 2, feature_map_BCHW.device).to(dtype))
            tokens.append(self.encoder_img_feat_input_proj(feature_map_BCHW).flatten(2).permute(2, 0, 1))
        return tokens, positions

    def forward(self, batch: dict[str, Tensor]) -> tuple[Tensor, tuple[Tensor | None, Tensor | None]]:
        """(actions (B, chunk_size, action_dim), (mu, log_sigma_x2))."""
        # Under FSDP mixed precision the parameters are already in the compute dtype here; match it.
        dtype = self.action_head.weight.dtype
        first = next(batch[key] for key in (ROBOT_STATE_KEY, ENV_STATE_KEY, *self.image_keys) if key in batch)
        batch_size, device = first.shape[0], first.device
        latent, mu, log_sigma_x2 = self._latent(batch, batch_size, dtype, device)

        vector_tokens = [self.encoder_latent_input_proj(latent)]
        if self.has_robot_state:
            vector_tokens.append(self.encoder_robot_state_input_proj(batch[ROBOT_STATE_KEY].to(dtype)))
        if self.has_env_state:
            vector_tokens.append(self.encoder_env_state_input_proj(batch[ENV_STATE_KEY].to(dtype)))
        tokens = [torch.stack(vector_tokens)]
        positions = [self.encoder_1d_feature_pos_embed.weight[:, None]]
        if self.image_keys:
            camera_tokens, camera_positions = self._camera_tokens(batch, dtype)
            tokens += camera_tokens
            positions += camera_positions
        tokens_SBD = torch.cat(tokens)
        pos_embed_S1D = torch.cat(positions)
        encoder_out_SBD = self.encoder(tokens_SBD, pos_embed_S1D)

        # As in DETR/ACT the decoder input is zero: the queries enter only as position embeddings.
        decoder_in_TBD = torch.zeros(self.config.chunk_size, batch_size, self.config.dim_model, dtype=dtype,
                                     device=device)
        decoded_TBD = self.decoder(decoder_in_TBD, encoder_out_SBD, self.decoder_pos_embed.weight[:, None],
                                   pos_embed_S1D)
        return self.action_head(decoded_TBD.transpose(0, 1)), (mu, log_sigma_x2)


class ACTTemporalEnsembler:
    """LeRobot's temporal ensembling: every step a new chunk is predicted and each upcoming action is the running
    mean of all predictions made for it, weighted exp(-coeff * i) with i = 0 for the oldest prediction."""

    def __init__(self, temporal_ensemble_coeff: float, chunk_size: int) -> None:
        self.chunk_size = chunk_size
        self.weights = torch.exp(-temporal_ensemble_coeff * torch.arange(chunk_size))
        self.weights_cumsum = torch.cumsum(self.weights, dim=0)
        self.reset()

    def reset(self) -> None:
        self.actions: Tensor | None = None  # (B, T, A): the ensembled actions of the steps to come
        self.counts: Tensor | None = None  # (T, 1): how many predictions each holds

    def update(self, actions_BTA: Tensor) -> Tensor:
        """The next action (B, A), given the chunk (B, chunk_size, A) just predicted."""
        self.weights = self.weights.to(actions_BTA.device)
        self.weights_cumsum = self.weights_cumsum.to(actions_BTA.device)
        if self.actions is None or self.counts is None:
            self.actions = actions_BTA.clone()
            self.counts = torch.ones(self.chunk_size, 1, dtype=torch.long, device=actions_BTA.device)
        else:
            self.actions = self.actions * self.weights_cumsum[self.counts - 1]
            self.actions = self.actions + actions_BTA[:, :-1] * self.weights[self.counts]
            self.actions = self.actions / self.weights_cumsum[self.counts]
            self.counts = torch.clamp(self.counts + 1, max=self.chunk_size)
            self.actions = torch.cat([self.actions, actions_BTA[:, -1:]], dim=1)
            self.counts = torch.cat([self.counts, torch.ones_like(self.counts[-1:])])
        action, self.actions, self.counts = self.actions[:, 0], self.actions[:, 1:], self.counts[1:]
        return action


class ACTPolicy(PreTrainedPolicy):
    name: ClassVar[str] = "act"
    config_class: ClassVar[type] = ACTConfig
    _fsdp_wrap_modules: ClassVar[list[str]] = ["ACTEncoderLayer", "ACTDecoderLayer"]
    # The feed-forward projections of every encoder/decoder layer. The attention is nn.MultiheadAttention: peft's
    # LoRA wrapper for it swaps parameters during forward, which FSDP2 cannot shard, and its out_proj is read as
    # a weight, never called, so an adapter there would silently do nothing.
    _peft_target_modules: ClassVar[list[str]] = ["linear1", "linear2"]

    def __init__(self, config: ACTConfig, input_features: dict[str, FeatureSpec],
                 output_features: dict[str, FeatureSpec], load_backbone_weights: bool = True) -> None:
        """``load_backbone_weights=False``: ignore ``pretrained_backbone_weights`` (a policy about to load a
        checkpoint, which holds the backbone's weights)."""
        super().__init__(config, input_features, output_features)
        self.config: ACTConfig = config
        self.model = ACT(config, self.input_features, self.output_features, load_backbone_weights)
        self._ensembler = None if config.temporal_ensemble_coeff is None else ACTTemporalEnsembler(
            config.temporal_ensemble_coeff, config.chunk_size)

    def _check_inputs(self, batch: dict[str, Tensor], need_action: bool) -> None:
        self._require_keys(batch, need_action)
        if need_action and batch["action"].shape[1] != self.config.chunk_size:
            raise ValueError(
                f"The batch's action chunk has {batch['action'].shape[1]} steps but "
                f"policy.chunk_size={self.config.chunk_size}; load action chunks of chunk_size frames."
            )

    def forward(self, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """L1 (``l1_reduction``) + kl_weight * KL (when the VAE ran), as LeRobot's. The logged parts are detached
        tensors on the loss's device: reading them would wait for the device."""
        self._check_inputs(batch, need_action=True)
        actions_hat_BTA, (mu, log_sigma_x2) = self.model(batch)
        target_BTA = batch["action"]
        action_is_pad_BT = batch.get("action_is_pad")
        if action_is_pad_BT is None:
            action_is_pad_BT = torch.zeros(target_BTA.shape[:2], dtype=torch.bool, device=target_BTA.device)
        valid_BT1 = ~action_is_pad_BT[..., None]
        # where() rather than a multiply so that NaN targets at padded positions cannot leak into the loss.
        abs_error_BTA = torch.where(valid_BT1, (actions_hat_BTA.float() - target_BTA.float()).abs(), 0.0)
        if self.config.l1_reduction == L1Reduction.valid_entries:
            # LeRobot 0.6.1: the mean over the non-padded entries (a device-side count: no host read).
            l1_loss = abs_error_BTA.sum() / (valid_BT1.sum() * abs_error_BTA.shape[-1]).clamp_min(1)
        else:
            l1_loss = abs_error_BTA.mean()
        if self.config.use_vae and mu is not None and log_sigma_x2 is not None:
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

    @torch.no_grad()
    def select_action(self, batch: dict[str, Tensor]) -> Tensor:
        """(B, action_dim): the next action; with ``temporal_ensemble_coeff`` a chunk is predicted every step and
        the action is the ensemble of every prediction made for this step."""
        if self._ensembler is None:
            return super().select_action(batch)
        return self._ensembler.update(self.predict_action_chunk(batch))

    def reset(self) -> None:
        super().reset()
        if self._ensembler is not None:
            self._ensembler.reset()
