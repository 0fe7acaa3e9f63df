"""A detector of the host-device round trips a training step would make on a GPU, usable on a CPU.

On a CPU there is one device, so the detector keeps its own account of which tensors are the host's: a tensor made
from Python or NumPy data (``torch.tensor``, ``as_tensor``, ``asarray``), by a factory given no device or the
device ``"cpu"`` by name, read back with ``.cpu()`` / ``.to("cpu")``, or one the caller names (the batch's
``sample_seed``, which stays on the host on purpose); what is computed from host tensors only stays the host's.
Every other tensor (the weights, the batch the loop copied to the device, what the policy computes from them, the
gradients) is the device's. Under :class:`HostSyncDetector` each of these is recorded, with the line of the code
that made it (the innermost frame outside torch):

- a device tensor read on the host: ``item``, ``tolist``, ``numpy``, ``bool()``/``int()``/``float()``, ``.cpu()``,
  ``.to("cpu")``, and the ops whose result's shape depends on the values (``nonzero``, ``masked_select``,
  ``unique``, a boolean index, ``repeat_interleave`` without ``output_size``, ...);
- host data copied to the device: ``torch.tensor(..., device=<a device>)``, ``.to(<a device>)`` or ``copy_`` of a
  host tensor (except the loop's own non-blocking copy of the batch, ``lerobot_mg.step.to_device``), and a host
  tensor of more than one element handed to an op with device tensors (on a GPU, a copy or an error).

On CUDA each of these waits for the device (or is a synchronous copy). 0-d host tensors mixed with device ones are
not recorded: a GPU kernel reads a CPU scalar as an argument, without waiting. Torch's optimizers keep their step
counts on the host (unless capturable or fused) and read them there, which needs no device either.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_HOST = "_host_sync_detector_host"
_TORCH_DIR = str(__import__("pathlib").Path(torch.__file__).parent)
# The loop's sanctioned copy of each batch (pinned by the DataLoader on a GPU, non-blocking).
_BATCH_COPY = ("lerobot_mg/step.py",)

_READS = {"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__", "cpu"}
_DATA_FACTORIES = {"tensor", "as_tensor", "asarray"}
_DATA_DEPENDENT = {"nonzero", "masked_select", "unique_dim", "_unique", "_unique2", "unique_consecutive",
                   "unique_dim_consecutive", "bincount", "_local_scalar_dense", "is_nonzero", "equal", "histc",
                   "argwhere", "nonzero_numpy"}


def is_host(tensor: Any) -> bool:
    return isinstance(tensor, torch.Tensor) and bool(getattr(tensor, _HOST, False))


def mark_host(tensor: torch.Tensor, host: bool = True) -> None:
    try:
        setattr(tensor, _HOST, host)
    except (AttributeError, RuntimeError):  # a tensor subclass that takes no attributes
        pass


def _names_host_device(device: Any) -> bool:
    """A factory's ``device`` argument that puts its result on the host: none, or ``"cpu"`` by name. A
    ``torch.device`` object is taken for the device (policies pass ``tensor.device``)."""
    return device is None or (isinstance(device, str) and device.split(":")[0] == "cpu")


def _target_device(args: tuple, kwargs: dict) -> tuple[bool, Any]:
    """(whether ``Tensor.to``'s arguments name a device, that device)."""
    if "device" in kwargs and kwargs["device"] is not None:
        return True, kwargs["device"]
    for arg in args[1:]:
        if isinstance(arg, (str, torch.device)):
            return True, arg
        if isinstance(arg, torch.Tensor):
            return True, "cpu" if is_host(arg) else torch.device("cpu")
    return False, None


def _where() -> str:
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith(_TORCH_DIR)
                                 or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


def _caller_file() -> str:
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith(_TORCH_DIR)
                                 or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    return "" if frame is None else frame.f_code.co_filename


def _in_torch_optim() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if "/torch/optim/" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def _tensors(values: Iterable[Any]) -> list[torch.Tensor]:
    return [value for value in tree_flatten(list(values))[0] if isinstance(value, torch.Tensor)]


class _Functions(TorchFunctionMode):
    def __init__(self, detector: HostSyncDetector) -> None:
        super().__init__()
        self.detector = detector

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        inputs = _tensors([args, kwargs])
        record = self.detector.record
        host_inputs = [t for t in inputs if is_host(t)]
        device_inputs = [t for t in inputs if not is_host(t)]
        if name in _DATA_FACTORIES and not any(isinstance(a, torch.Tensor) for a in args[:1]):
            out = func(*args, **kwargs)
            if _names_host_device(kwargs.get("device")):
                mark_host(out)
            elif not _in_torch_optim():
                record(f"torch.{name}(<host data>, device=...) copies host data to the device", _where())
            return out
        if name in _READS and device_inputs and inputs[0] is device_inputs[0] and not _in_torch_optim():
            record(f"Tensor.{name}() of a device tensor", _where())
        if name == "to" and inputs:
            names, target = _target_device(args, kwargs)
            if names and is_host(inputs[0]) and not _names_host_device(target):
                sanctioned = kwargs.get("non_blocking") and _caller_file().endswith(_BATCH_COPY)
                if not sanctioned:
                    record("Tensor.to(<device>) of a host tensor copies it to the device", _where())
                out = func(*args, **kwargs)
                mark_host(out, False)
                return out
            if names and not is_host(inputs[0]) and _names_host_device(target) and target is not None:
                record("Tensor.to('cpu') of a device tensor", _where())
                out = func(*args, **kwargs)
                mark_host(out)
                return out
        if name == "copy_" and len(inputs) >= 2 and not is_host(inputs[0]) and is_host(inputs[1]) \
                and inputs[1].numel() > 1:
            record("Tensor.copy_ of a host tensor into a device tensor", _where())
        elif host_inputs and device_inputs and any(t.numel() > 1 for t in host_inputs) and not _in_torch_optim():
            record(f"{name}: a host tensor used with device tensors (a copy, or an error, on a GPU)", _where())
        factory = not inputs
        out = func(*args, **kwargs)
        if name == "cpu" or (factory and _names_host_device(kwargs.get("device"))) or (inputs and not device_inputs):
            for tensor in _tensors([out]):
                mark_host(tensor)
        return out


class _Dispatch(TorchDispatchMode):
    def __init__(self, detector: HostSyncDetector) -> None:
        super().__init__()
        self.detector = detector

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        inputs = _tensors([args, kwargs])
        flagged = name in _DATA_DEPENDENT or (name == "repeat_interleave" and kwargs.get("output_size") is None
                                               and any(t.dtype == torch.long for t in inputs[:1]))
        if name == "index" and any(t.dtype == torch.bool for t in inputs[1:]):
            flagged = True
        if flagged and inputs and not all(is_host(t) for t in inputs) and not _in_torch_optim():
            self.detector.record(f"aten.{name} waits for the device's values", _where())
        return func(*args, **kwargs)


class HostSyncDetector:
    """``with HostSyncDetector() as found:`` records in ``found.events`` (what, where) each host-device round trip
    (see the module docstring); :meth:`host` marks tensors as the host's."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        self._modes = (_Functions(self), _Dispatch(self))

    def record(self, what: str, where: str) -> None:
        self.events.append((what, where))

    @staticmethod
    def host(*tensors: torch.Tensor) -> None:
        for tensor in tensors:
            mark_host(tensor)

    def __enter__(self) -> HostSyncDetector:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    def summary(self) -> list[str]:
        """Each distinct round trip once: ``<where>: <what>``."""
        return sorted({f"{where}: {what}" for what, where in self.events})
