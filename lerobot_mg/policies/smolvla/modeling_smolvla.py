"""SmolVLA (Shukor et al. 2025) as LeRobot 0.6.1 builds it: the same modules, state_dict names, order and dtypes, and
the same arithmetic, so LeRobot's checkpoints load here and give its numbers, and ours load there.

The prefix is every camera through SmolVLM's vision encoder and connector (each image resized with padding to
``resize_imgs_with_padding``, mapped to [-1, 1], its features scaled by sqrt(VLM width)), the task's tokens (scaled
the same way) and the state (zero-padded to ``max_state_dim``, projected to one token). The suffix is the noisy
action chunk (zero-padded to ``max_action_dim``) fused with a sine-cosine embedding of the flow-matching time. Both
run through the joint layers (:mod:`.smolvlm_with_expert`); the expert's output is projected to the velocity.

Training (flow matching): x_t = t * noise + (1 - t) * actions, the loss is the squared error to noise - actions over
the dataset's action dims, padded chunk steps zeroed, divided by (valid steps x action dims). Noise and time come
from each sample's own seed (``SAMPLE_SEED_KEY``), so every data-parallel layout trains on the same draws; without
seeds they come from the global RNG, as in LeRobot, and ``forward(batch, noise=, time=)`` takes them explicitly.
Inference: the prefix runs once and its keys and values are kept; ``num_steps`` Euler steps from t = 1 to 0 then run
the suffix against them.

Sharding: each joint layer (VLM layer i with expert layer i) is one unit (:meth:`SmolVLAPolicy.fsdp_unit_groups`),
the vision encoder's layers are units, and activation checkpointing recomputes each joint layer.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F  # noqa: N812
from safetensors.torch import load_file
from torch import Tensor, nn

from lerobot_mg.config.smolvla import SmolVLAConfig
from lerobot_mg.errors import config_error
from lerobot_mg.policies.base import (
    SAMPLE_SEED_KEY,
    WEIGHTS_NAME,
    FeatureSpec,
    PreTrainedPolicy,
    load_state_dict_strictly,
)
from lerobot_mg.policies.saved_config import CONFIG_NAME
from lerobot_mg.policies.smolvla.smolvlm_with_expert import KVCache, SmolVLMWithExpertModel
from lerobot_mg.policies.smolvla.vlm import load_vlm_weights, smolvlm_config, vlm_weight_files
from lerobot_mg.policies.vla.common import (
    LANGUAGE_ATTENTION_MASK,
    LANGUAGE_TOKENS,
    blank_empty_camera,
    euler_integrate,
    example_language,
    flow_matching_losses,
    flow_matching_pair,
    init_like_transformers,
    make_att_2d_masks,
    pad_vector,
    per_sample_noise_and_time,
    position_ids_from_pad_masks,
    reduce_action_losses,
    resize_with_pad_top_left,
    sample_noise,
    sample_time_beta,
    sinusoidal_time_embedding,
    zero_padded_action_dims,
)

OBS_STATE = "observation.state"
EMPTY_CAMERA_PREFIX = "observation.images.empty_camera_"
# LeRobot's shape for the empty cameras it adds to the input features (never read: their images are all black).
_EMPTY_CAMERA_SHAPE = [3, 480, 640]
# SmolVLA's flow-matching time distribution: Beta(1.5, 1) * 0.999 + 0.001.
TIME_BETA = {"alpha": 1.5, "beta": 1.0, "scale": 0.999, "offset": 0.001}


def cross_attention_layers(config: SmolVLAConfig) -> list[bool]:
    """Per joint layer, whether the expert cross-attends to the prefix (LeRobot's rule)."""
    every = config.self_attn_every_n_layers
    return [
        "cross" in config.attention_mode and not (every > 0 and index % every == 0)
        for index in range(config.num_vlm_layers)
    ]


def _pad_sequence(tensor: Tensor, length: int) -> Tensor:
    """(B, L, ...) zero-padded along L to ``length``."""
    padded = tensor.new_zeros((tensor.shape[0], length, *tensor.shape[2:]))
    padded[:, : tensor.shape[1]] = tensor
    return padded


class SmolVLAFlowMatching(nn.Module):
    """LeRobot's ``VLAFlowMatching``: the VLM with its expert and the projections around them."""

    def __init__(self, config: SmolVLAConfig, load_weights: bool) -> None:
        super().__init__()
        self.config = config
        weight_files = vlm_weight_files(config.vlm_model_name) if config.load_vlm_weights and load_weights else None
        vlm_config = smolvlm_config(config)
        cross = cross_attention_layers(config)
        self.vlm_with_expert = SmolVLMWithExpertModel(vlm_config, config.num_vlm_layers, cross,
                                                      config.expert_width_multiplier)
        vlm_width = vlm_config.text_config.hidden_size
        expert_width = self.vlm_with_expert.expert_hidden_size
        self.state_proj = nn.Linear(config.max_state_dim, vlm_width)
        self.action_in_proj = nn.Linear(config.max_action_dim, expert_width)
        self.action_out_proj = nn.Linear(expert_width, config.max_action_dim)
        self.action_time_mlp_in = nn.Linear(expert_width * 2, expert_width)
        self.action_time_mlp_out = nn.Linear(expert_width, expert_width)
        self._initialise(vlm_config.text_config.initializer_range)
        if config.load_vlm_weights:
            self._to_lerobot_pretrained_dtypes()
            if weight_files is not None:
                load_vlm_weights(self.vlm_with_expert.vlm, config.vlm_model_name, weight_files)
        self._set_requires_grad()

    def _cross_kv_projections(self) -> list[nn.Linear]:
        return [
            projection for layer in self.vlm_with_expert.lm_expert.layers if layer.cross_attention
            for projection in (layer.self_attn.k_proj, layer.self_attn.v_proj)
        ]

    def _initialise(self, std: float) -> None:
        # The cross-attention k/v projections keep PyTorch's default init: LeRobot creates them after the
        # expert's own initialisation.
        vlm = self.vlm_with_expert.vlm
        skip = set(self._cross_kv_projections())
        for part in (vlm.model.connector, vlm.model.text_model, vlm.lm_head, self.vlm_with_expert.lm_expert):
            init_like_transformers(part, std, skip)

    def _to_lerobot_pretrained_dtypes(self) -> None:
        """The dtypes of LeRobot's build from the VLM's published weights: the VLM and the expert in bfloat16, but
        the expert's cross-attention k/v projections, the projections around them and every buffer in float32."""
        keep = {id(p) for projection in self._cross_kv_projections() for p in projection.parameters()}
        for part in (self.vlm_with_expert.vlm, self.vlm_with_expert.lm_expert):
            for parameter in part.parameters():
                if id(parameter) not in keep:
                    parameter.data = parameter.data.to(torch.bfloat16)

    def _set_requires_grad(self) -> None:
        """LeRobot's choice of frozen parameters: the vision encoder (freeze_vision_encoder), the whole VLM
        (train_expert_only), else the VLM parts whose output never reaches the loss (the last layer, the final
        norm, the language head); the state projection trains with train_state_proj."""
        config = self.config
        vlm = self.vlm_with_expert.vlm
        if config.freeze_vision_encoder:
            vlm.model.vision_model.requires_grad_(False)
        if config.train_expert_only:
            vlm.requires_grad_(False)
        else:
            last = f"text_model.layers.{config.num_vlm_layers - 1}."
            for name, parameter in vlm.named_parameters():
                if "lm_head" in name or "text_model.norm.weight" in name or last in name:
                    parameter.requires_grad = False
        self.state_proj.requires_grad_(config.train_state_proj)

    def train(self, mode: bool = True) -> SmolVLAFlowMatching:
        """As LeRobot: the frozen vision encoder (and the frozen VLM) stay in eval mode."""
        super().train(mode)
        if self.config.freeze_vision_encoder:
            self.vlm_with_expert.vlm.model.vision_model.eval()
        if self.config.train_expert_only:
            self.vlm_with_expert.vlm.eval()
        return self

    def embed_prefix(self, images: list[Tensor], img_masks: list[Tensor], lang_tokens: Tensor, lang_masks: Tensor,
                     state: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(embeddings (B, L, VLM width), pad masks (B, L), block starts (B, L)) of the image tokens of each
        camera, the language tokens and the state token; images and language see each other, the state starts a
        block of its own."""
        embeddings, pad_masks = [], []
        for image, image_mask in zip(images, img_masks, strict=True):
            image_embedding = self.vlm_with_expert.embed_image(image)
            width = image_embedding.shape[-1]
            # sqrt(width) rounded to the embedding's dtype first, as LeRobot's tensor of it (made on the device).
            image_embedding = image_embedding * torch.full((), width**0.5, dtype=image_embedding.dtype,
                                                           device=image_embedding.device)
            batch_size, num_tokens = image_embedding.shape[:2]
            embeddings.append(image_embedding)
            pad_masks.append(image_mask[:, None].expand(batch_size, num_tokens))
        language = self.vlm_with_expert.embed_language_tokens(lang_tokens)
        language = language * math.sqrt(language.shape[-1])
        embeddings.append(language)
        pad_masks.append(lang_masks)
        state_embedding = self.state_proj(state)
        state_embedding = state_embedding[:, None, :] if state_embedding.ndim == 2 else state_embedding
        embeddings.append(state_embedding)
        batch_size, state_length = state_embedding.shape[:2]
        pad_masks.append(torch.ones(batch_size, state_length, dtype=torch.bool, device=state_embedding.device))
        embedding = torch.cat(embeddings, dim=1)
        pad_mask = torch.cat(pad_masks, dim=1)
        # Every image and language token 0, the state tokens 1 (made on the device, not copied from a list).
        block = (torch.arange(pad_mask.shape[1], device=pad_mask.device) >= pad_mask.shape[1] - state_length)[None, :]
        if pad_mask.shape[1] < self.config.prefix_length:
            embedding = _pad_sequence(embedding, self.config.prefix_length)
            pad_mask = _pad_sequence(pad_mask, self.config.prefix_length)
            block = _pad_sequence(block, self.config.prefix_length)
        return embedding, pad_mask, block.expand(batch_size, -1)

    def embed_suffix(self, noisy_actions: Tensor, time: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(embeddings (B, chunk, expert width), pad masks, block starts) of the noisy actions fused with the time
        embedding by a two-layer SiLU MLP; each action token starts a block (causal over the chunk)."""
        action_embedding = self.action_in_proj(noisy_actions)
        time_embedding = sinusoidal_time_embedding(time, self.vlm_with_expert.expert_hidden_size,
                                                   self.config.min_period, self.config.max_period)
        time_embedding = time_embedding.type(dtype=action_embedding.dtype)[:, None, :].expand_as(action_embedding)
        fused = self.action_time_mlp_in(torch.cat([action_embedding, time_embedding], dim=2))
        fused = self.action_time_mlp_out(F.silu(fused))
        batch_size, length = fused.shape[:2]
        pad_mask = torch.ones(batch_size, length, dtype=torch.bool, device=fused.device)
        block = torch.ones(self.config.chunk_size, dtype=fused.dtype, device=fused.device)
        return fused, pad_mask, block[None, :].expand(batch_size, -1)

    def velocity(self, suffix_out: Tensor) -> Tensor:
        return self.action_out_proj(suffix_out[:, -self.config.chunk_size :].to(dtype=torch.float32))

    def forward(self, images: list[Tensor], img_masks: list[Tensor], lang_tokens: Tensor, lang_masks: Tensor,
                state: Tensor, actions: Tensor, noise: Tensor, time: Tensor) -> Tensor:
        """Elementwise squared error (B, chunk, max_action_dim) of the predicted velocity at ``time``."""
        x_t, u_t = flow_matching_pair(actions, noise, time)
        prefix, prefix_pad, prefix_blocks = self.embed_prefix(images, img_masks, lang_tokens, lang_masks, state)
        suffix, suffix_pad, suffix_blocks = self.embed_suffix(x_t, time)
        pad_masks = torch.cat([prefix_pad, suffix_pad], dim=1)
        att_2d_masks = make_att_2d_masks(pad_masks, torch.cat([prefix_blocks, suffix_blocks], dim=1))
        _, suffix_out, _ = self.vlm_with_expert(att_2d_masks, position_ids_from_pad_masks(pad_masks), prefix, suffix)
        return flow_matching_losses(u_t, self.velocity(suffix_out))

    def prefix_cache(self, images: list[Tensor], img_masks: list[Tensor], lang_tokens: Tensor, lang_masks: Tensor,
                     state: Tensor) -> tuple[Tensor, KVCache]:
        """(prefix pad masks, every layer's prefix keys and values): the prefix pass of inference."""
        prefix, prefix_pad, prefix_blocks = self.embed_prefix(images, img_masks, lang_tokens, lang_masks, state)
        _, _, cache = self.vlm_with_expert(make_att_2d_masks(prefix_pad, prefix_blocks),
                                           position_ids_from_pad_masks(prefix_pad), prefix, None)
        return prefix_pad, cache

    def denoise_step(self, prefix_pad: Tensor, cache: KVCache, x_t: Tensor, time: Tensor) -> Tensor:
        """The velocity at ``x_t``, ``time``: the suffix against the cached prefix."""
        suffix, suffix_pad, suffix_blocks = self.embed_suffix(x_t, time)
        batch_size, prefix_length = prefix_pad.shape
        prefix_2d = prefix_pad[:, None, :].expand(batch_size, suffix_pad.shape[1], prefix_length)
        att_2d_masks = torch.cat([prefix_2d, make_att_2d_masks(suffix_pad, suffix_blocks)], dim=2)
        positions = position_ids_from_pad_masks(suffix_pad, offset=torch.sum(prefix_pad, dim=-1)[:, None])
        _, suffix_out, _ = self.vlm_with_expert(att_2d_masks, positions, None, suffix, cache)
        return self.velocity(suffix_out)

    def sample_actions(self, images: list[Tensor], img_masks: list[Tensor], lang_tokens: Tensor,
                       lang_masks: Tensor, state: Tensor, noise: Tensor) -> Tensor:
        """(B, chunk, max_action_dim): ``noise`` integrated from t = 1 to 0 in ``num_steps`` Euler steps."""
        prefix_pad, cache = self.prefix_cache(images, img_masks, lang_tokens, lang_masks, state)
        return euler_integrate(lambda x_t, time: self.denoise_step(prefix_pad, cache, x_t, time), noise,
                               self.config.num_steps)


class SmolVLAPolicy(PreTrainedPolicy):
    """LeRobot's ``SmolVLAPolicy``: its state_dict is ``model.vlm_with_expert.vlm.*`` (vision encoder, connector,
    the kept language layers, language head), ``model.vlm_with_expert.lm_expert.*``, ``model.state_proj``,
    ``model.action_in_proj``, ``model.action_out_proj``, ``model.action_time_mlp_in/out``.

    ``load_backbone_weights=False`` builds it without reading the VLM's published weights (with
    ``load_vlm_weights=true`` it still takes their dtypes): what a policy about to receive a checkpoint's weights
    wants.
    """

    name: ClassVar[str] = "smolvla"
    config_class: ClassVar[type] = SmolVLAConfig
    # The vision encoder's layers are FSDP units; the joint layers are declared by fsdp_unit_groups.
    _fsdp_wrap_modules: ClassVar[list[str]] = ["SmolVLMEncoderLayer"]
    # Activation checkpointing recomputes each joint layer (the VLM layer's forward runs the expert layer's).
    _checkpoint_modules: ClassVar[list[str]] = ["SmolVLAVLMLayer"]
    # LeRobot's default LoRA targets for SmolVLA: the expert's query and value projections (a regex over the
    # module names).
    # LeRobot 0.6.1's default LoRA targets: the expert's q/v projections and the action/state/time projections.
    _peft_target_modules: ClassVar[str] = (r"(model\.vlm_with_expert\.lm_expert\..*\.(q|v)_proj|model\.(state_proj"
                                           r"|action_in_proj|action_out_proj|action_time_mlp_in|action_time_mlp_out))")

    def __init__(
        self,
        config: SmolVLAConfig,
        input_features: dict[str, FeatureSpec],
        output_features: dict[str, FeatureSpec],
        *,
        load_backbone_weights: bool = True,
    ) -> None:
        super().__init__(config, input_features, output_features)
        self.config: SmolVLAConfig = config
        if "action" not in output_features or len(output_features["action"]["shape"]) != 1:
            raise config_error("output_features", output_features, "SmolVLA needs a 1-D 'action' output feature",
                               "a dataset (dataset.root) whose 'action' feature is 1-D")
        self.action_dim = int(output_features["action"]["shape"][0])
        # As LeRobot, the empty cameras are input features (config.json lists them); their images are black.
        for index in range(config.empty_cameras):
            self.input_features[f"{EMPTY_CAMERA_PREFIX}{index}"] = {"type": "VISUAL", "shape": _EMPTY_CAMERA_SHAPE}
        self.image_keys = [key for key, spec in self.input_features.items() if spec["type"] == "VISUAL"]
        self._check_features()
        self.model = SmolVLAFlowMatching(config, load_backbone_weights)

    def _check_features(self) -> None:
        config = self.config
        if not self.image_keys:
            raise config_error("policy.observation_keys", config.observation_keys,
                               "select no camera, and SmolVLA needs at least one image",
                               "policy.observation_keys=null (every observation.* feature), or a dataset with a camera")
        state = self.input_features.get(OBS_STATE)
        if state is None:
            raise config_error("policy.observation_keys", config.observation_keys, f"select no {OBS_STATE!r}",
                               f"policy.observation_keys=null, or a list holding {OBS_STATE}")
        for key, width, limit in ((OBS_STATE, int(state["shape"][-1]), "max_state_dim"),
                                  ("action", self.action_dim, "max_action_dim")):
            if width > getattr(config, limit):
                raise config_error(f"policy.{limit}", getattr(config, limit),
                                   f"is narrower than the dataset's {key!r} ({width} dims)", f"policy.{limit}={width}")

    def load_weights(self, directory: Path, map_location: str | torch.device = "cpu") -> None:
        """Load ``directory``'s model.safetensors strictly. With ``load_vlm_weights`` the parameters keep the dtypes
        of LeRobot's build from the VLM's published weights (bfloat16 VLM and expert) and the stored values are
        cast to them, as LeRobot loads them; otherwise as every policy (the stored dtypes)."""
        if not self.config.load_vlm_weights:
            super().load_weights(directory, map_location)
            return
        weights_path = Path(directory) / WEIGHTS_NAME
        if not weights_path.is_file():
            super().load_weights(directory, map_location)  # its error names the missing file
        state_dict = load_file(str(weights_path), device=str(map_location))
        load_state_dict_strictly(self, state_dict, str(weights_path), str(Path(directory) / CONFIG_NAME))

    def example_batch(self, batch_size: int) -> dict[str, Tensor]:
        """The base's zeros plus a prompt of tokenizer_max_length tokens (the longest the processor makes) and each
        sample's seed, on the host whatever the default device (the training noise is drawn there from it)."""
        return {**super().example_batch(batch_size), **example_language(batch_size, self.config.tokenizer_max_length),
                SAMPLE_SEED_KEY: torch.arange(batch_size, device="cpu")}

    def fsdp_unit_groups(self) -> list[tuple[nn.Module, ...]]:
        """The joint layers, each sharded as one unit: (VLM language layer i, expert layer i)."""
        vlm_with_expert = self.model.vlm_with_expert
        return list(zip(vlm_with_expert.vlm_layers, vlm_with_expert.lm_expert.layers, strict=True))

    def _camera_keys_present(self, batch: dict[str, Tensor]) -> list[str]:
        return [key for key in self.image_keys if key in batch]

    def _require_keys(self, batch: dict[str, Tensor], need_action: bool) -> None:
        required = [OBS_STATE, LANGUAGE_TOKENS, LANGUAGE_ATTENTION_MASK] + (["action"] if need_action else [])
        missing = [key for key in required if key not in batch]
        if missing or not self._camera_keys_present(batch):
            raise ValueError(f"The smolvla policy's batch lacks {missing or self.image_keys}; it has {sorted(batch)}"
                             " (the language keys come from its preprocessor's tokenizer step).")

    def _push_observation(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        # One frame of history (observation_delta_indices = [0]): each input present gains its time axis of 1
        # (the empty cameras never are).
        return {**batch, **{key: batch[key][:, None] for key in self.input_features if key in batch}}

    def prepare_images(self, batch: dict[str, Tensor]) -> tuple[list[Tensor], list[Tensor]]:
        """Per camera: the last frame, resized with padding to ``resize_imgs_with_padding`` ([width, height]),
        mapped from [0, 1] to [-1, 1], and its mask (the batch's ``<key>_padding_mask``, else all true; all -1 and
        masked in the samples whose ``empty_camera_key(key)`` is True); then an all-black masked image for each
        missing camera, up to ``empty_cameras``."""
        images, masks = [], []
        resize = self.config.resize_imgs_with_padding
        for key in self._camera_keys_present(batch):
            image = batch[key][:, -1] if batch[key].ndim == 5 else batch[key]
            if resize is not None:
                image = resize_with_pad_top_left(image, resize[1], resize[0], pad_value=0)
            mask_key = f"{key}_padding_mask"
            mask = (batch[mask_key].bool() if mask_key in batch
                    else torch.ones(image.shape[0], dtype=torch.bool, device=image.device))
            image, mask = blank_empty_camera(batch, key, image * 2.0 - 1.0, mask)
            images.append(image)
            masks.append(mask)
        missing = len(self.image_keys) - len(images)
        for _ in range(min(missing, self.config.empty_cameras)):
            images.append(torch.ones_like(images[-1]) * -1)
            masks.append(torch.zeros_like(masks[-1]))
        return images, masks

    def prepare_state(self, batch: dict[str, Tensor]) -> Tensor:
        state = batch[OBS_STATE][:, -1, :] if batch[OBS_STATE].ndim > 2 else batch[OBS_STATE]
        return pad_vector(state, self.config.max_state_dim)

    def _inputs(self, batch: dict[str, Tensor]) -> tuple[list[Tensor], list[Tensor], Tensor, Tensor, Tensor]:
        images, img_masks = self.prepare_images(batch)
        return images, img_masks, batch[LANGUAGE_TOKENS], batch[LANGUAGE_ATTENTION_MASK], self.prepare_state(batch)

    def _training_draws(self, batch: dict[str, Tensor], shape: tuple[int, ...], device: torch.device
                        ) -> tuple[Tensor, Tensor]:
        """(noise, time): from each sample's seed when the batch has them, else from the global RNG (noise first,
        as LeRobot draws them)."""
        seeds = batch.get(SAMPLE_SEED_KEY)
        if seeds is not None:
            return per_sample_noise_and_time(seeds.tolist(), shape[1:], device, **TIME_BETA)
        noise = sample_noise(shape, device)
        return noise, sample_time_beta(shape[0], device, **TIME_BETA)

    def forward(self, batch: dict[str, Tensor], noise: Tensor | None = None, time: Tensor | None = None,
                reduction: str = "mean") -> tuple[Tensor, dict[str, Tensor]]:
        """LeRobot's SmolVLA loss: the squared velocity error over the dataset's action dims, the steps past the
        episode end (``action_is_pad``) zeroed, divided by (valid steps x action dims); a dataset mixture's batch
        (``ACTION_DIM_PAD_KEY``) is the mean of each sample's mean over its real steps and dims (see
        :func:`reduce_action_losses`); ``reduction="none"``
        gives it per sample (B,). ``noise`` (B, chunk, max_action_dim) and ``time`` (B,) replace the random draws."""
        self._require_keys(batch, need_action=True)
        actions = pad_vector(zero_padded_action_dims(batch, batch["action"]), self.config.max_action_dim)
        if noise is None or time is None:
            drawn_noise, drawn_time = self._training_draws(batch, tuple(actions.shape), actions.device)
            noise = drawn_noise if noise is None else noise
            time = drawn_time if time is None else time
        losses = self.model(*self._inputs(batch), actions, noise, time)[:, :, : self.action_dim]
        logs = {"losses_after_forward": losses.detach().mean()}
        return reduce_action_losses(batch, losses, reduction, mask_steps=True), logs

    @torch.no_grad()
    def predict_action_chunk(self, batch: dict[str, Tensor], noise: Tensor | None = None) -> Tensor:
        """(B, chunk_size, action_dim) actions in normalised space, denoised from ``noise`` (B, chunk_size,
        max_action_dim) (else fresh Gaussian noise)."""
        self._require_keys(batch, need_action=False)
        images, img_masks, tokens, token_masks, state = self._inputs(batch)
        if noise is None:
            noise = sample_noise((state.shape[0], self.config.chunk_size, self.config.max_action_dim), state.device)
        actions = self.model.sample_actions(images, img_masks, tokens, token_masks, state, noise)
        return actions[:, :, : self.action_dim]
