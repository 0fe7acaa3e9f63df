"""LoRA through the ``peft`` library: wrapping the base, checking ``peft.*``, and the adapter checkpoint.

The trained module is peft's ``PeftModel``: its module names begin with ``base_model.model.`` (what
``accelerator.fsdp.ignored_modules`` is matched against), LoRA layers replace the targeted modules in place (so
the policy's FSDP wrap units are still found by class name), and ``full_training_modules`` become peft's
``modules_to_save``: trainable copies beside the frozen originals. A checkpoint stores the trainable parameters
only, under the keys peft's own ``get_peft_model_state_dict`` gives them (``adapter_model.safetensors``:
``base_model.model.<module>.lora_A.weight`` / ``lora_B.weight``), with the ``LoraConfig`` as
``PeftModel.save_pretrained`` writes it (``adapter_config.json``: inference mode, the base model path and class):
the layout of a LeRobot 0.6.1 LoRA checkpoint, which PEFT's ``PeftModel.from_pretrained`` loads on the base. A
LeRobot LoRA checkpoint loads here the same way, its relative base path resolved as
:func:`lerobot_mg.peft.base.adapter_base_path` says (in the current directory, as PEFT and LeRobot look). The base is
recorded so that others can load it (:class:`lerobot_mg.peft.base.BaseRecord`: a Hub repo id and its commit, or a path
relative to the current directory), with the sha256 of its weights, which loading checks. :func:`save_merged` writes the merged policy as a plain
``pretrained_model/``.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from lerobot_mg.checkpoint import layout as L
from lerobot_mg.config.schema import PeftConfig, TrainConfig
from lerobot_mg.errors import ConfigError, config_error
from lerobot_mg.peft.base import BASE_SHA256_KEY, BaseRecord, adapter_base_path, base_features
from lerobot_mg.policies.base import PreTrainedPolicy, safetensors_ready
from lerobot_mg.policies.registry import get_policy_class, load_pretrained

if TYPE_CHECKING:
    from peft import LoraConfig, PeftModel

METHOD_TYPES = ("LORA",)
PEFT_NAME_PREFIX = "base_model.model."  # what PeftModel puts before the policy's own module names
ADAPTER_NAME = "default"
# The attribute of a wrapped model that holds its base's BaseRecord (what adapter_config.json records of the base).
_BASE_RECORD = "lerobot_mg_base"
# Module types peft's LoRA adapts. nn.MultiheadAttention is refused on sharded runs (see _check_target).
_LORA_TYPES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding, nn.MultiheadAttention)


def _matches(module_name: str, target: str) -> bool:
    """peft's rule for a name in a list: the whole module name, or its last dotted components."""
    return module_name == target or module_name.endswith(f".{target}")


def resolve_targets(peft_cfg: PeftConfig, policy_class: type[PreTrainedPolicy]) -> list[str] | str:
    """The LoRA targets as peft takes them: a list of module names (or name suffixes), or one regular expression
    (a string, as LeRobot declares the VLAs' defaults) that peft matches against each whole module name."""
    targets = peft_cfg.target_modules if peft_cfg.target_modules is not None else policy_class._peft_target_modules
    return targets if isinstance(targets, str) else list(targets)


def _matched_modules(targets: list[str] | str, modules: dict[str, nn.Module]) -> dict[str, list[str]]:
    """Each target (the regex, or each name of the list) -> the module names peft adapts for it."""
    if isinstance(targets, str):
        pattern = re.compile(targets)
        return {targets: [name for name in modules if name and pattern.fullmatch(name)]}
    return {target: [name for name in modules if name and _matches(name, target)] for target in targets}


def _skeleton(cfg: TrainConfig) -> PreTrainedPolicy:
    """The policy of this run without memory (meta device): its module names and types only."""
    inputs, outputs = base_features(str(cfg.policy.path))
    with torch.device("meta"):
        return get_policy_class(cfg.policy.type)(cfg.policy, inputs, outputs, load_backbone_weights=False)


def check_peft_config(cfg: TrainConfig, sharded: bool) -> None:
    """Every ``peft.*`` user error, before any process group: the values, then each module name against the
    policy's modules. ``policy.path`` must already be checked."""
    peft_cfg = cfg.peft
    if peft_cfg.method_type not in METHOD_TYPES:
        raise config_error(
            "peft.method_type", peft_cfg.method_type, f"must be one of {METHOD_TYPES} (or null for no PEFT)",
            "peft.method_type=LORA",
        )
    if peft_cfg.r < 1:
        raise config_error("peft.r", peft_cfg.r, "must be >= 1", "peft.r=16")
    if peft_cfg.lora_alpha is not None and peft_cfg.lora_alpha <= 0:
        raise config_error(
            "peft.lora_alpha", peft_cfg.lora_alpha, "must be > 0 (null: equal to peft.r, a scale of 1)",
            "peft.lora_alpha=null",
        )
    if not 0.0 <= peft_cfg.dropout < 1.0:
        raise config_error("peft.dropout", peft_cfg.dropout, "must be in [0, 1)", "peft.dropout=0.0")
    if cfg.policy.path is None:
        raise config_error(
            "policy.path", None, f"peft.method_type={peft_cfg.method_type} fine-tunes a pretrained base, and none "
            "is given", "policy.path=<run>/checkpoints/last/pretrained_model",
        )
    skeleton = _skeleton(cfg)
    modules = dict(skeleton.named_modules())
    inside_attention = {
        f"{name}.{child}" if name else child
        for name, module in modules.items() if isinstance(module, nn.MultiheadAttention)
        for child, _ in module.named_modules() if child
    }
    adaptable = sorted({name.rsplit(".", 1)[-1] for name, module in modules.items()
                        if isinstance(module, _LORA_TYPES) and name not in inside_attention})
    targets = resolve_targets(peft_cfg, type(skeleton))
    if not targets:
        raise config_error(
            "peft.target_modules", targets, f"{type(skeleton).__name__} declares no default LoRA targets",
            f"peft.target_modules='[{adaptable[0]}]' (the policy has {adaptable})",
        )
    try:
        matches = _matched_modules(targets, modules)
    except re.error as error:
        raise config_error("peft.target_modules", targets, f"is not a regular expression ({error})",
                           "a pattern Python's re module compiles, or a list of module names") from error
    for target, matched in matches.items():
        if not matched:
            how = ("as a regular expression it matches no whole module name" if isinstance(targets, str)
                   else "names no module")
            raise config_error(
                "peft.target_modules", targets, f"{target!r} {how} of {type(skeleton).__name__}",
                f"choose among its adaptable modules {adaptable}",
            )
        for name in matched:
            _check_target(targets, target, name, modules[name], name in inside_attention, sharded, adaptable)
    for module_name in peft_cfg.full_training_modules or []:
        if not any(_matches(name, module_name) for name in modules if name):
            names = sorted({name.rsplit(".", 1)[-1] for name in modules if name})
            raise config_error(
                "peft.full_training_modules", list(peft_cfg.full_training_modules or []),
                f"{module_name!r} names no module of {type(skeleton).__name__}", f"choose among {names}",
            )
    pattern = cfg.accelerator.fsdp.ignored_modules
    if sharded and pattern is not None:
        from peft import get_peft_model

        regex = re.compile(pattern)
        # The names the run's PEFT model has (LoRA's base_layer / lora_A / lora_B, full-training copies' ...),
        # from the skeleton wrapped as the run wraps the base.
        wrapped = get_peft_model(skeleton, _lora_config(peft_cfg, type(skeleton)), adapter_name=ADAPTER_NAME)
        if not any(regex.fullmatch(name) for name, _ in wrapped.named_modules() if name):
            raise config_error(
                "accelerator.fsdp.ignored_modules", pattern,
                f"matches no module of the PEFT model, whose module names begin with {PEFT_NAME_PREFIX!r} and "
                "are matched whole", f"begin the pattern with '.*', e.g. accelerator.fsdp.ignored_modules='.*{pattern}'",
            )


def _check_target(targets: list[str] | str, target: str, name: str, module: nn.Module, in_attention: bool,
                  sharded: bool, adaptable: list[str]) -> None:
    if in_attention:
        raise config_error(
            "peft.target_modules", targets,
            f"{target!r} matches {name}, inside nn.MultiheadAttention, which reads its weight directly and never "
            "calls it: the adapter would have no effect", f"choose among {adaptable}",
        )
    if not isinstance(module, _LORA_TYPES):
        raise config_error(
            "peft.target_modules", targets,
            f"{target!r} matches {name}, a {type(module).__name__}; LoRA adapts Linear, Conv and Embedding layers",
            f"choose among {adaptable}",
        )
    if sharded and isinstance(module, nn.MultiheadAttention):
        raise config_error(
            "peft.target_modules", targets,
            f"{target!r} matches {name}, an nn.MultiheadAttention: peft's LoRA for it swaps parameters inside "
            "forward, which FSDP2 cannot shard", f"choose among {adaptable}, or train unsharded",
        )


def _lora_config(peft_cfg: PeftConfig, policy_class: type[PreTrainedPolicy]) -> LoraConfig:
    """peft's LoraConfig of ``peft.*``; the targets as :func:`resolve_targets` gives them (a regex unchanged: peft
    full-matches a string against each module name)."""
    from peft import LoraConfig

    alpha = peft_cfg.alpha()
    return LoraConfig(
        r=peft_cfg.r,
        # Always explicit: peft's default (8) would scale the adapter by 8 / r. An integer when it is one (PEFT's type).
        lora_alpha=int(alpha) if alpha.is_integer() else alpha,
        lora_dropout=peft_cfg.dropout,
        target_modules=resolve_targets(peft_cfg, policy_class),
        modules_to_save=list(peft_cfg.full_training_modules) if peft_cfg.full_training_modules else None,
        bias="none",
    )


def wrap_with_lora(policy: PreTrainedPolicy, peft_cfg: PeftConfig, base_path: str,
                   base_name: str | None = None) -> PeftModel:
    """The base frozen, LoRA adapters (fp32) on the targets, trainable copies of ``full_training_modules`` (in
    the base's dtype). ``base_path`` is the base's directory here, ``base_name`` the base as typed (``policy.path``,
    or the ``policy.pretrained_path`` that records it): adapter_config.json records it as :class:`BaseRecord`
    says, with the sha256 of the base's weights."""
    from peft import get_peft_model

    config = _lora_config(peft_cfg, type(policy))
    model = get_peft_model(policy, config, adapter_name=ADAPTER_NAME)
    # get_peft_model takes the name from the model (a transformers attribute our policies lack).
    # In memory the base is where it is on this machine (PEFT looks there for its config.json); the files name it
    # as BaseRecord says (see write_configs).
    record = BaseRecord.of(base_name or base_path, base_path)
    config.base_model_name_or_path = str(record.directory)
    setattr(model, _BASE_RECORD, record)
    _mark_peft(policy.config, record.name)
    return model


def _mark_peft(policy_cfg: Any, base_path: str | None) -> None:
    """LeRobot's record of a PEFT policy in its config (config.json, train_config.json): ``use_peft`` and the base
    in ``pretrained_path``; LeRobot's loaders read an adapter directory as one only when ``use_peft`` is true."""
    names = {field.name for field in dataclasses.fields(policy_cfg)}
    for name, value in (("use_peft", base_path is not None), ("pretrained_path", base_path)):
        if name in names:
            setattr(policy_cfg, name, value)


def is_peft_model(model: nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


@dataclass
class AdapterWeights:
    """What a PEFT run checkpoints: its trainable parameters, under the keys of adapter_model.safetensors.

    ``key_of`` maps a parameter's FQN (as ``torch.distributed.checkpoint.state_dict`` names it, the same under
    DDP and FSDP2) to its adapter key; peft itself computes the renaming (adapter name removed, full-training
    copies under the original module's name), so a converted DCP checkpoint and a gathered one agree key for key.
    """

    model: nn.Module  # the PeftModel (before DDP / FSDP wrapping)
    key_of: dict[str, str]

    @classmethod
    def of(cls, model: nn.Module) -> AdapterWeights | None:
        """None for a model without PEFT (its checkpoints hold model.safetensors)."""
        if not is_peft_model(model):
            return None
        from peft import get_peft_model_state_dict

        names = [name for name, param in model.named_parameters() if param.requires_grad]
        # Distinct placeholder tensors: peft renames and filters the dict, and identity says which went where.
        placeholders = {name: torch.empty(0) for name in names}
        # save_embedding_layers=False: no vocabulary is ever resized here, and peft's "auto" would read the base's
        # config class back with transformers' from_pretrained, which a policy config has not.
        renamed = get_peft_model_state_dict(model, state_dict=placeholders, adapter_name=ADAPTER_NAME,
                                            save_embedding_layers=False)
        name_of = {id(tensor): name for name, tensor in placeholders.items()}
        key_of = {name_of[id(tensor)]: key for key, tensor in renamed.items()}
        if sorted(key_of) != sorted(names) or len(set(key_of.values())) != len(key_of):
            raise RuntimeError(f"peft's adapter state dict does not cover the trainable parameters one to one: "
                               f"{sorted(set(names) - set(key_of))}")
        return cls(model, key_of)

    def to_adapter(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """The trainable entries of a model state dict, under adapter keys."""
        missing = sorted(set(self.key_of) - set(state_dict))
        if missing:
            raise RuntimeError(f"the state dict lacks trainable parameters {missing[:5]}")
        return {self.key_of[name]: state_dict[name] for name in self.key_of}

    def to_model(self, adapter_state: dict[str, Any], source: Path) -> dict[str, Any]:
        """Adapter keys back to parameter FQNs; raises if ``source`` does not hold exactly this adapter."""
        name_of = {key: name for name, key in self.key_of.items()}
        if adapter_state.keys() != name_of.keys():
            raise ConfigError(
                f"{source} does not hold this run's adapter: missing {sorted(name_of.keys() - adapter_state.keys())[:5]},"
                f" unexpected {sorted(adapter_state.keys() - name_of.keys())[:5]}. Fix: resume with the peft.* "
                "settings the checkpoint was saved with"
            )
        return {name_of[key]: value for key, value in adapter_state.items()}

    def write_configs(self, directory: Path) -> None:
        """config.json (the policy) and adapter_config.json (the LoRA settings and the base model), as
        ``PeftModel.save_pretrained`` writes it: in inference mode, with the base model's class, and beside it the
        sha256 of the base's weights (computed once per run), which loading checks."""
        base = self.model.get_base_model()
        base.write_config(directory)
        config = copy.deepcopy(self.model.peft_config[ADAPTER_NAME])
        config.inference_mode = True
        auto_mapping = {"base_model_class": type(base).__name__, "parent_library": type(base).__module__}
        record: BaseRecord | None = getattr(self.model, _BASE_RECORD, None)
        if record is not None:
            config.base_model_name_or_path, config.revision = record.name, record.revision
            auto_mapping[BASE_SHA256_KEY] = record.sha256()
        config.save_pretrained(str(directory), auto_mapping_dict=auto_mapping)

    def write(self, directory: Path, adapter_state: dict[str, Tensor]) -> None:
        """The configs and adapter_model.safetensors (``adapter_state`` is keyed like it); main process only."""
        self.write_configs(directory)
        save_file(safetensors_ready(adapter_state), str(Path(directory) / L.ADAPTER_SAFETENSORS),
                  metadata={"format": "pt"})


def load_adapter_policy(directory: Path, map_location: str = "cpu", merge_adapter: bool = True,
                        chain: tuple[Path, ...] = ()) -> nn.Module:
    """Base (the one adapter_config.json records, checked against its digest) + adapter, in eval mode.
    ``merge_adapter`` folds the adapter into the base weights and returns the plain policy; otherwise the PeftModel
    (same outputs). ``chain``: the adapters whose base this one is (a loop among them is refused)."""
    from peft import PeftConfig as LibraryPeftConfig  # the peft extra: imported by runs that use it
    from peft import PeftModel

    base_path = adapter_base_path(directory, chain)  # a relative path or a Hub repo id resolved
    base = load_policy(Path(base_path), map_location=map_location, merge_adapter=True,
                       chain=(*chain, Path(directory).resolve()))
    config = LibraryPeftConfig.from_pretrained(str(directory))
    config.base_model_name_or_path = base_path
    model = PeftModel.from_pretrained(base, str(directory), adapter_name=ADAPTER_NAME, is_trainable=False,
                                      config=config)
    model.to(map_location)
    model.eval()
    return model.merge_and_unload() if merge_adapter else model


def load_policy(directory: Path, map_location: str = "cpu", merge_adapter: bool = True,
                chain: tuple[Path, ...] = ()) -> nn.Module:
    """Load any ``pretrained_model`` directory: a whole policy, or a PEFT run's adapter applied to the base
    adapter_config.json records, merged into the weights (``merge_adapter``: a plain policy) or kept as a peft
    model that forwards the policy's methods."""
    if (Path(directory) / L.ADAPTER_CONFIG_JSON).is_file():
        return load_adapter_policy(Path(directory), map_location, merge_adapter, chain)
    return load_pretrained(Path(directory), map_location=map_location)


def save_merged(adapter_dir: Path, out_dir: Path) -> None:
    """The PEFT checkpoint in ``adapter_dir`` as a plain ``pretrained_model/`` in ``out_dir``: the adapter merged
    into its base (config.json + model.safetensors, no PEFT record), with the adapter's processors and
    train_config.json beside it. LeRobot's and our ``from_pretrained`` load it like any policy."""
    adapter_dir, out_dir = Path(adapter_dir), Path(out_dir)
    merged = load_adapter_policy(adapter_dir, merge_adapter=True)
    _mark_peft(merged.config, None)
    merged.save_pretrained(out_dir)
    for path in sorted(adapter_dir.glob("policy_*")) + [adapter_dir / L.TRAIN_CONFIG_JSON]:
        if path.is_file():
            shutil.copy2(path, out_dir / path.name)
