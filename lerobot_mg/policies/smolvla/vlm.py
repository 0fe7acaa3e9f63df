"""The VLM SmolVLA is built on: its architecture (a transformers ``SmolVLMConfig``) and, for a new policy that
starts from it, its published weights.

SmolVLM2-500M-Video-Instruct's architecture is held here as data (its public config values), so the full-size model
builds offline without asking the Hub; a ``vlm_model_name`` that is a local folder is read from its config.json.
``vlm_config_overrides`` replaces fields of either. Weights (``load_vlm_weights=true``) come from the folder's
``*.safetensors``, or for the Hub model from huggingface_hub's cache (downloaded into it unless ``HF_HUB_OFFLINE=1``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import snapshot_download
from safetensors.torch import load_file
from torch import nn
from transformers import SmolVLMConfig

from lerobot_mg.config.smolvla import SMOLVLM2_500M, VLM_SUB_CONFIGS, SmolVLAConfig, is_local_vlm
from lerobot_mg.errors import ConfigError, config_error

# HuggingFaceTB/SmolVLM2-500M-Video-Instruct's architecture (its published config.json's values).
SMOLVLM2_500M_CONFIG: dict[str, Any] = {
    "text_config": {
        "model_type": "llama", "hidden_size": 960, "num_hidden_layers": 32, "num_attention_heads": 15,
        "num_key_value_heads": 5, "head_dim": 64, "intermediate_size": 2560, "vocab_size": 49280,
        "rope_theta": 100000.0, "max_position_embeddings": 8192, "rms_norm_eps": 1e-05, "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
    },
    "vision_config": {
        "model_type": "smolvlm_vision", "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
        "intermediate_size": 3072, "image_size": 512, "patch_size": 16, "hidden_act": "gelu_pytorch_tanh",
        "layer_norm_eps": 1e-06,
    },
    "scale_factor": 4,
    "image_token_id": 49190,
    "tie_word_embeddings": False,
}
# The files of the Hub model that load_vlm_weights reads.
_WEIGHT_PATTERNS = ["*.safetensors", "*.safetensors.index.json", "config.json"]


def _base_values(name: str) -> dict[str, Any]:
    if name == SMOLVLM2_500M:
        return json.loads(json.dumps(SMOLVLM2_500M_CONFIG))  # a deep copy
    return SmolVLMConfig.from_pretrained(name).to_dict()


def smolvlm_config(config: SmolVLAConfig) -> SmolVLMConfig:
    """The VLM's architecture for ``config``: ``vlm_model_name``'s values with ``vlm_config_overrides`` on top. An
    override naming a field the SmolVLM config lacks is a ConfigError."""
    values = _base_values(config.vlm_model_name)
    known = SmolVLMConfig().to_dict()
    for key, value in config.vlm_config_overrides.items():
        if key not in known:
            raise config_error(f"policy.vlm_config_overrides.{key}", value, "is not a field of SmolVLMConfig",
                               f"one of {', '.join(sorted(set(known) - {'transformers_version'}))}")
        if key in VLM_SUB_CONFIGS:
            section = getattr(SmolVLMConfig(), key).to_dict()
            for field_name, field_value in value.items():
                if field_name not in section and field_name != "rope_theta":
                    raise config_error(f"policy.vlm_config_overrides.{key}.{field_name}", field_value,
                                       f"is not a field of the VLM's {key}",
                                       f"one of {', '.join(sorted(section))}")
                values.setdefault(key, {})[field_name] = field_value
        else:
            values[key] = value
    if "rope_theta" in values.get("text_config", {}) and "rope_parameters" in values["text_config"]:
        values["text_config"]["rope_parameters"]["rope_theta"] = values["text_config"].pop("rope_theta")
    return SmolVLMConfig(**values)


def _weight_folder(name: str) -> Path:
    if is_local_vlm(name):
        return Path(name)
    try:
        # Offline, huggingface_hub reads its cache without asking the Hub (HF_HUB_OFFLINE=1).
        return Path(snapshot_download(name, repo_type="model", allow_patterns=_WEIGHT_PATTERNS))
    except Exception as error:  # not cached offline, no network, no such repo
        reason = " ".join(f"{type(error).__name__}: {error}".split())[:200]
        raise config_error(
            "policy.vlm_model_name", name,
            f"with policy.load_vlm_weights=true needs the VLM's weights, which could not be had ({reason})",
            f"fetch them while online: hf download {name} --include '*.safetensors' '*.json', or "
            "policy.load_vlm_weights=false",
        ) from error


def load_vlm_weights(vlm: nn.Module, name: str) -> None:
    """Copy the VLM's published weights (``model.vision_model.*``, ``model.connector.*``, ``model.text_model.*``,
    ``lm_head.weight``) into ``vlm`` (LeRobot's ``vlm_with_expert.vlm``), each cast to its parameter's dtype. The
    language layers SmolVLA drops are skipped; a weight ``vlm`` needs and the files lack is a ConfigError."""
    folder = _weight_folder(name)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise config_error("policy.vlm_model_name", name, f"holds no *.safetensors weights in {folder}",
                           "a folder holding the VLM's weights, or policy.load_vlm_weights=false")
    wanted = vlm.state_dict()
    stored: dict[str, torch.Tensor] = {}
    for path in files:
        stored.update({key: tensor for key, tensor in load_file(str(path)).items() if key in wanted})
    missing = sorted(set(wanted) - set(stored))
    if missing:
        raise ConfigError(f"policy.vlm_model_name={name!r}: its weights in {folder} lack {missing[:5]} (of "
                          f"{len(missing)} missing). Fix: the folder of a SmolVLM whose architecture matches its "
                          "config.json, or policy.load_vlm_weights=false")
    try:
        vlm.load_state_dict(stored, strict=True)
    except RuntimeError as error:  # shapes that do not fit the architecture
        raise ConfigError(f"policy.vlm_model_name={name!r}: its weights do not fit the VLM its config describes: "
                          f"{' '.join(str(error).split())[:300]}. Fix: a SmolVLM folder whose weights and "
                          "config.json belong together, or policy.load_vlm_weights=false") from error
