"""FSDP wrap units: which submodules become their own FSDP unit, and the checks around that choice.

Accelerate's own size-based policy crashes on ``nn.ModuleList`` containers (``fully_shard`` needs a module
with a ``forward``) and its class-name policy silently wraps only the root when the wrap policy is missing, so
the unit selection is ours: one list of modules, checked, then sharded with the same arguments accelerate
uses for the root.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


def select_wrap_units(
    model: nn.Module, wrap_modules: list[str] | None, min_num_params: int | None
) -> tuple[list[tuple[str, nn.Module]], str]:
    """(name, module) of every wrap unit, bottom-up, and a description of the rule that chose them.

    Precedence: ``accelerator.fsdp.wrap_modules``, then ``accelerator.fsdp.min_num_params``, then the policy
    class's ``_fsdp_wrap_modules``. With none of the three, or a rule that matches nothing but the root, the run
    stops: a root-only wrap forfeits all sharding memory savings.
    """
    # A peft model wraps the policy (LoRA layers replace modules in place): the declaration is the policy's.
    policy = model.get_base_model() if hasattr(model, "get_base_model") else model
    declared = list(getattr(type(policy), "_fsdp_wrap_modules", []) or [])
    if wrap_modules:
        class_names, rule = list(wrap_modules), f"accelerator.fsdp.wrap_modules={list(wrap_modules)}"
    elif min_num_params is not None:
        class_names, rule = None, f"accelerator.fsdp.min_num_params={min_num_params}"
    elif declared:
        class_names, rule = declared, f"{type(policy).__name__}._fsdp_wrap_modules={declared}"
    else:
        raise ValueError(
            f"accelerator.fsdp.wrap_modules=None: {type(policy).__name__} declares no _fsdp_wrap_modules, so a "
            "sharded run would wrap only the root module and save no memory. Fix: "
            "accelerator.fsdp.wrap_modules='[\"MyTransformerBlock\"]' or accelerator.fsdp.min_num_params=1000000"
        )

    if class_names is not None:
        present = {type(m).__name__ for m in model.modules()}
        missing = [name for name in class_names if name not in present]
        if missing:
            raise ValueError(
                f"accelerator.fsdp.wrap_modules={class_names}: no module of class {missing} in "
                f"{type(model).__name__}. Fix: use class names that exist, e.g. one of "
                f"{sorted(present - {type(model).__name__})[:12]}"
            )
        chosen = [(n, m) for n, m in model.named_modules() if n and type(m).__name__ in class_names]
    else:
        chosen = _size_based_units(model, min_num_params)  # type: ignore[arg-type]
    if not chosen:
        raise ValueError(
            f"{rule} selects no submodule: only the root would be wrapped, which saves no memory. Fix: "
            "a smaller accelerator.fsdp.min_num_params or accelerator.fsdp.wrap_modules='[\"...\"]'"
        )
    # Bottom-up so inner units are sharded before the units that contain them.
    chosen.sort(key=lambda item: item[0].count("."), reverse=True)
    return chosen, rule


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


def find_split_ties(model: nn.Module, units: Iterable[tuple[str, nn.Module]]) -> list[str]:
    """Descriptions of parameters shared between different FSDP units (the root counts as one unit).

    FSDP cannot split a tied parameter across units: torch >= 2.12 stops at the first forward, older
    versions silently untie it. We refuse before the first step on every version.
    """
    unit_of_module: dict[int, str] = {}
    for unit_name, unit in sorted(units, key=lambda item: item[0].count(".")):  # outer first, inner overwrite
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
