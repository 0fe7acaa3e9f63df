"""Wrap units: which submodules become their own FSDP unit, the checks around that choice, and the two
per-unit transforms applied before sharding (activation checkpointing, torch.compile).

A policy declares units two ways. ``fsdp_unit_groups()`` returns groups of modules that form ONE unit each (the
joint layers of a vision-language-action policy: VLM layer i with expert layer i, see
``PreTrainedPolicy.fsdp_unit_groups``); they are sharded first, with ``fully_shard([m1, m2])``. The class names of
``_fsdp_wrap_modules`` (or the config's ``accelerator.fsdp.wrap_modules`` / ``min_num_params``) choose the other
units, one module each.

Accelerate's own size-based policy crashes on ``nn.ModuleList`` containers (``fully_shard`` needs a module
with a ``forward``) and its class-name policy silently wraps only the root when the wrap policy is missing, so
the unit selection is ours: one list of modules, checked, then sharded with the same arguments accelerate
uses for the root.

Both transforms replace a unit's ``forward`` on the instance and leave its class, hooks and parameter names
alone: checkpoints, state dicts and FSDP's hooks (which run around ``forward``) are the same with or without them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lerobot_mg.config.schema import AcceleratorConfig
from lerobot_mg.errors import ConfigError

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)
# At most this many min_num_params suggestions in an error message.
_MAX_SUGGESTIONS = 4

NamedModules = list[tuple[str, nn.Module]]


@dataclass(frozen=True)
class UnitGroup:
    """Modules that FSDP2 shards as one unit (gathered together, resharded after the last of them ran)."""

    names: tuple[str, ...]  # module names in the model, in the policy's order
    modules: tuple[nn.Module, ...]

    @property
    def label(self) -> str:
        return " + ".join(self.names)


@dataclass
class UnitPlan:
    """What happens to which submodules of a model before it is wrapped."""

    units: NamedModules  # single-module wrap units, bottom-up (sharded runs shard them)
    rule: str  # the rule that chose them
    sharded: bool
    checkpointed: NamedModules  # blocks whose activations are recomputed in backward
    compiled: NamedModules  # modules whose forward torch.compile compiles
    groups: list[UnitGroup] = field(default_factory=list)  # the policy's fsdp_unit_groups(), sharded first
    # Modules holding only parameters the policy declares unused (unused_parameter_names), outside every other
    # unit: sharded as units of their own, which no pass ever calls, so they are never gathered.
    idle: NamedModules = field(default_factory=list)

    def describe(self) -> list[str]:
        """Log lines: the joint units, the units and their rule, then how many modules each transform applies to,
        with an example."""
        lines = []
        if self.groups:
            what = "joint units" if self.sharded else "joint units (not sharded)"
            lines.append(f"{what}: {len(self.groups)} ({describe_group(self.groups[0])}), e.g. "
                         f"{self.groups[-1].label}")
        if self.units:
            what = "FSDP wrap units" if self.sharded else "wrap units (not sharded)"
            lines.append(f"{what} ({self.rule}): {len(self.units)} units, e.g. {self.units[-1][0]}")
        if self.idle and self.sharded:
            lines.append(f"never gathered (unused parameters, in checkpoints only): {len(self.idle)} units, e.g. "
                         f"{self.idle[-1][0]}")
        for what, modules in (("activation checkpointing", self.checkpointed), ("torch.compile", self.compiled)):
            if modules:
                lines.append(f"{what}: {len(modules)} modules, e.g. {modules[-1][0]}")
        return lines


def plan_units(model: nn.Module, acc_cfg: AcceleratorConfig, sharded: bool) -> UnitPlan:
    """Choose the wrap units (sharded runs, or per-unit transforms) and what the two transforms apply to.

    The policy's ``fsdp_unit_groups()`` are units of a sharded run whatever else is set; a policy that declares
    them needs no class rule. Activation checkpointing recomputes the model's declared blocks
    (``_checkpoint_modules``), else its outermost wrap units; compile takes the outermost wrap units, else the
    model's top-level modules. Where either would have nothing to apply to this raises rather than silently doing
    nothing.
    """
    fsdp = acc_cfg.fsdp
    units: NamedModules = []
    rule = "no rule"
    groups = declared_groups(model)
    wanted = sharded or acc_cfg.activation_checkpointing or acc_cfg.compile
    if (sharded and not groups) or (wanted and has_wrap_rule(model, fsdp.wrap_modules, fsdp.min_num_params)):
        units, rule = select_wrap_units(model, fsdp.wrap_modules, fsdp.min_num_params)
    group_members = [(name, module) for group in groups for name, module in zip(group.names, group.modules)]
    checkpointed: NamedModules = []
    if acc_cfg.activation_checkpointing:
        checkpointed = declared_checkpoint_blocks(model) or outermost(units + group_members)
        if not checkpointed:
            raise no_rule_error(
                model, "accelerator.activation_checkpointing=true has no block to recompute",
                declarations="_fsdp_wrap_modules or _checkpoint_modules",
            )
    compiled = (outermost(units + group_members) or top_level_modules(model)) if acc_cfg.compile else []
    if acc_cfg.compile and not compiled:
        raise ConfigError(
            f"accelerator.compile=True: {type(policy_of(model)).__name__} has no wrap unit and no submodule with parameters, so "
            "nothing would be compiled. Fix: accelerator.fsdp.wrap_modules='[\"MyBlock\"]', or accelerator.compile=false"
        )
    idle = idle_modules(model, units, groups) if sharded else []
    return UnitPlan(units, rule, sharded, checkpointed, compiled, groups, idle)


def idle_modules(model: nn.Module, units: NamedModules, groups: list[UnitGroup]) -> NamedModules:
    """The outermost modules all of whose parameters the policy declares unused (``unused_parameter_names``) and
    that no unit or group already holds (pi0's language-model heads): each can be a unit that is never gathered."""
    declare = getattr(policy_of(model), "unused_parameter_names", None)
    unused = set(declare() if declare is not None else [])
    if not unused:
        return []
    prefix = "" if policy_of(model) is model else _prefix_of(model, policy_of(model))
    unused = {f"{prefix}{name}" for name in unused}
    taken = [name for name, _ in units] + [name for group in groups for name in group.names]
    candidates = [
        (name, module) for name, module in model.named_modules()
        if name and any(True for _ in module.parameters())
        and all(f"{name}.{param_name}" in unused for param_name, _ in module.named_parameters())
        and not any(name == other or name.startswith(f"{other}.") or other.startswith(f"{name}.") for other in taken)
    ]
    return outermost(candidates)


def _prefix_of(model: nn.Module, inner: nn.Module) -> str:
    """``"base_model.model."``-style: the name of ``inner`` in ``model`` with a trailing dot."""
    return next(f"{name}." for name, module in model.named_modules() if module is inner)


def declared_groups(model: nn.Module) -> list[UnitGroup]:
    """The policy's ``fsdp_unit_groups()`` with each module's name in ``model``; checked: every member is a
    submodule, and no module is in two groups or a group inside another's member (a policy bug: ValueError)."""
    policy = policy_of(model)
    declare = getattr(policy, "fsdp_unit_groups", None)
    declared = declare() if declare is not None else []
    if not declared:
        return []
    name_of = {id(module): name for name, module in model.named_modules() if name}
    groups, seen = [], {}
    for members in declared:
        members = tuple(members)
        missing = [type(m).__name__ for m in members if id(m) not in name_of]
        if missing or not members:
            raise ValueError(f"{type(policy).__name__}.fsdp_unit_groups(): a group holds modules that are not "
                             f"submodules of the model: {missing or 'an empty group'}")
        group = UnitGroup(tuple(name_of[id(m)] for m in members), members)
        for name in group.names:
            clash = next((other for other in seen if other == name or name.startswith(f"{other}.")
                          or other.startswith(f"{name}.")), None)
            if clash is not None:
                raise ValueError(f"{type(policy).__name__}.fsdp_unit_groups(): {name} overlaps {clash} of the group "
                                 f"{seen[clash]}; a module belongs to one unit")
            seen[name] = group.label
        groups.append(group)
    return groups


def describe_group(group: UnitGroup) -> str:
    """The members' names with the layer index written ``i``: ``vlm.layers.i + expert.layers.i``."""
    return " + ".join(".".join("i" if part.isdigit() else part for part in name.split(".")) for name in group.names)


def select_wrap_units(
    model: nn.Module, wrap_modules: list[str] | None, min_num_params: int | None
) -> tuple[list[tuple[str, nn.Module]], str]:
    """(name, module) of every wrap unit, bottom-up, and a description of the rule that chose them.

    Precedence: ``accelerator.fsdp.wrap_modules``, then ``accelerator.fsdp.min_num_params``, then the policy
    class's ``_fsdp_wrap_modules``. With none of the three, or a rule that matches nothing but the root, the run
    stops: a root-only wrap forfeits all sharding memory savings.
    """
    policy = policy_of(model)
    declared = _declared(model)
    if wrap_modules:
        class_names, rule = list(wrap_modules), f"accelerator.fsdp.wrap_modules={list(wrap_modules)}"
    elif min_num_params is not None:
        class_names, rule = None, f"accelerator.fsdp.min_num_params={min_num_params}"
    elif declared:
        class_names, rule = declared, f"{type(policy).__name__}._fsdp_wrap_modules={declared}"
    else:
        raise no_rule_error(model, "a sharded run would wrap only the root module and save no memory")

    if class_names is not None:
        check_wrap_classes(model, class_names)
        chosen = [(n, m) for n, m in model.named_modules() if n and type(m).__name__ in class_names]
    else:
        chosen = _size_based_units(model, min_num_params)  # type: ignore[arg-type]
    if not chosen:
        raise ConfigError(
            f"{rule} selects no submodule: only the root would be wrapped, which saves no memory. Fix: "
            "a smaller accelerator.fsdp.min_num_params or accelerator.fsdp.wrap_modules='[\"...\"]'"
        )
    # Bottom-up so inner units are sharded before the units that contain them.
    chosen.sort(key=lambda item: item[0].count("."), reverse=True)
    return chosen, rule


def check_wrap_classes(model: nn.Module, class_names: list[str]) -> None:
    """Every class ``accelerator.fsdp.wrap_modules`` names exists in ``model``; the error lists the classes it has."""
    present = {type(m).__name__ for m in model.modules()}
    missing = [name for name in class_names if name not in present]
    if missing:
        raise ConfigError(
            f"accelerator.fsdp.wrap_modules={list(class_names)}: no module of class {missing} in "
            f"{type(model).__name__}, whose classes are {sorted(present - {type(model).__name__})}. Fix: "
            "accelerator.fsdp.wrap_modules=[<some of those classes>]"
        )


def policy_of(model: nn.Module) -> nn.Module:
    """The policy whose declarations count: a peft model wraps the policy (LoRA layers replace modules in place)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _declared(model: nn.Module) -> list[str]:
    return list(getattr(type(policy_of(model)), "_fsdp_wrap_modules", []) or [])


def has_wrap_rule(model: nn.Module, wrap_modules: list[str] | None, min_num_params: int | None) -> bool:
    """Whether any rule (the config's or the policy's declaration) chooses units for ``model``."""
    return bool(wrap_modules) or min_num_params is not None or bool(_declared(model))


def no_rule_error(model: nn.Module, consequence: str, declarations: str = "_fsdp_wrap_modules") -> ConfigError:
    """The error for a model without declared units and neither override, with size thresholds to pick from:
    "<Model> declares no <declarations>, so <consequence>"."""
    suggestions = ", ".join(
        f"accelerator.fsdp.min_num_params={threshold} gives {num_units} units" for threshold, num_units in
        size_rule_options(model)
    )
    return ConfigError(
        f"accelerator.fsdp.wrap_modules=None and accelerator.fsdp.min_num_params=None: {type(policy_of(model)).__name__} "
        f"declares no {declarations}, so {consequence}. Fix: {suggestions or 'accelerator.fsdp.min_num_params=<N>'}"
        f" (of {sum(p.numel() for p in model.parameters()):,} parameters), or "
        "accelerator.fsdp.wrap_modules='[\"MyBlock\"]'"
    )


def size_rule_options(model: nn.Module) -> list[tuple[int, int]]:
    """(min_num_params, number of units it gives) for thresholds halving from half the model's size, rounded
    to two significant digits; the first few distinct unit counts of two or more."""
    total = sum(p.numel() for p in model.parameters())
    options: list[tuple[int, int]] = []
    threshold = total // 2
    while threshold >= 1 and len(options) < _MAX_SUGGESTIONS:
        rounded = int(float(f"{threshold:.2g}"))
        num_units = len(_size_based_units(model, rounded))
        if num_units >= 2 and all(num_units != count for _, count in options):
            options.append((rounded, num_units))
        threshold //= 2
    return options


def _size_based_units(model: nn.Module, min_num_params: int) -> list[tuple[str, nn.Module]]:
    """Every non-container submodule holding at least ``min_num_params`` parameters not already claimed by
    a smaller chosen unit below it (as torch's size-based auto-wrap policy counts them)."""
    chosen: list[tuple[str, nn.Module]] = []
    claimed: set[int] = set()
    named = [(n, m) for n, m in model.named_modules() if n]
    for name, module in sorted(named, key=lambda item: item[0].count("."), reverse=True):
        if isinstance(module, _CONTAINERS):
            continue
        unclaimed = sum(p.numel() for p in module.parameters() if id(p) not in claimed)
        if unclaimed >= min_num_params:
            chosen.append((name, module))
            claimed.update(id(p) for p in module.parameters())
    return chosen


def find_split_ties(model: nn.Module, units: Iterable[tuple[str, nn.Module]],
                    groups: Iterable[UnitGroup] = ()) -> list[str]:
    """Descriptions of parameters shared between different FSDP units (the root counts as one unit, each group
    of ``groups`` as one unit).

    FSDP cannot split a tied parameter across units: torch >= 2.12 stops at the first forward, older
    versions silently untie it. We refuse before the first step on every version.
    """
    placed = [*units, *((group.label, module) for group in groups for module in group.modules)]
    depth_of = {id(module): name.count(".") for name, module in model.named_modules()}
    unit_of_module: dict[int, str] = {}
    for unit_name, unit in sorted(placed, key=lambda item: depth_of.get(id(item[1]), 0)):  # outer first, inner overwrite
        for module in unit.modules():
            unit_of_module[id(module)] = unit_name
    owners: dict[int, dict[str, str]] = {}
    for module_name, module in model.named_modules():
        owning_unit = unit_of_module.get(id(module), "<root>")
        for param_name, param in module.named_parameters(recurse=False):
            full = f"{module_name}.{param_name}" if module_name else param_name
            owners.setdefault(id(param), {}).setdefault(owning_unit, full)
    problems = []
    for by_unit in owners.values():
        if len(by_unit) > 1:
            placed = ", ".join(f"{name} (unit {unit})" for unit, name in sorted(by_unit.items()))
            problems.append(placed)
    return problems


def outermost(units: Iterable[tuple[str, nn.Module]]) -> NamedModules:
    """The units no other unit contains: a transform applied to them covers the nested ones once."""
    units = list(units)
    names = {name for name, _ in units}
    return [
        (name, module) for name, module in units
        if not any(name.startswith(f"{other}.") for other in names if other != name)
    ]


def declared_checkpoint_blocks(model: nn.Module) -> NamedModules:
    """The outermost modules of the classes the model declares for activation checkpointing."""
    class_names = list(getattr(type(policy_of(model)), "_checkpoint_modules", []) or [])
    return outermost((n, m) for n, m in model.named_modules() if n and type(m).__name__ in class_names)


def top_level_modules(model: nn.Module, prefix: str = "") -> NamedModules:
    """The direct children that hold parameters: the whole network of a policy, without its own forward (the
    loss and its random draws), for torch.compile when no wrap unit is chosen. A child without a forward of its
    own (a container such as LeRobot's ``diffusion`` model, whose methods call its children) is never called, so
    its children stand in for it."""
    found: NamedModules = []
    for name, child in model.named_children():
        if not any(True for _ in child.parameters()):
            continue
        if type(child).forward is nn.Module.forward:
            found.extend(top_level_modules(child, f"{prefix}{name}."))
        else:
            found.append((f"{prefix}{name}", child))
    return found


def checkpoint_activations(module: nn.Module) -> None:
    """Recompute ``module``'s activations in backward instead of keeping them.

    Non-reentrant checkpointing: it composes with DDP's and FSDP2's hooks and with torch.compile, and restores
    the RNG state for the recomputation, so dropout draws the same mask and gradients equal the run without it.
    """
    forward = module.forward

    @functools.wraps(forward)
    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = checkpointed


def compile_forward(module: nn.Module) -> None:
    """torch.compile ``module.forward`` (the hooks around it, e.g. FSDP's, stay eager)."""
    forward: Callable[..., Any] = module.forward
    module.forward = torch.compile(forward)


def freeze_unused(model: nn.Module) -> list[str]:
    """``requires_grad=False`` on the parameters the policy declares unused (``unused_parameter_names``); their
    names. Nothing for a model that declares none."""
    freeze = getattr(policy_of(model), "freeze_unused_parameters", None)
    return freeze() if freeze is not None else []
