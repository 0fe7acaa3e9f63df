"""Every collective of the package is valid on NCCL: the rule of docs/launching.md ("Collectives and backends"),
held call site by call site.

The rule: the run's default process group maps each device type to its backend (``cuda:nccl,cpu:gloo`` on a GPU
run, gloo on a CPU run), and the device-mesh groups of FSDP2/HSDP inherit that map; host-side agreement that must
not wait on the GPU uses an explicit gloo group of its own; object collectives let torch pick a device the group
serves. CI runs on gloo, which takes CPU and CUDA tensors alike, so a collective that only NCCL refuses would pass
every other test: this one reads the source instead. It lists every call that communicates (``ast``), and each
must sit in :data:`SITES` with the reason the rule covers it; a new site, a site that moved, or a group created
with another backend fails here until it is classified.
"""

from __future__ import annotations

import ast
from collections import Counter
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import pytest
from torch.distributed.distributed_c10d import Backend, BackendConfig

from lerobot_mg.distributed.accelerator import CPU_BACKEND, GPU_BACKEND, process_group_backend
from tests.launch_utils import PYTHON, REPO, clean_env, free_port, rank_env, run_watched

PACKAGE = REPO / "lerobot_mg"


class Cover(Enum):
    """Why the rule covers a call site."""

    # A tensor collective on the default group: its backend map serves CPU tensors (gloo) and CUDA tensors (NCCL).
    DEFAULT_GROUP = "default group with the backend map"
    # DTensor, FSDP2 state-dict and gradient-norm reductions over the device mesh, whose groups inherit the default
    # group's map: a CPU-offloaded shard reduces on gloo, a GPU one on NCCL.
    MESH_GROUPS = "device-mesh groups, which inherit the backend map"
    # CPU tensors (or DCP's planning objects) on an explicit gloo group the caller passes.
    HOST_GROUP = "explicit gloo group"
    # all_gather_object / broadcast_object_list: torch pickles onto a device the group serves.
    OBJECT = "object collective"
    # DCP save/load: planning by object collectives on the group given (an asynchronous save's gloo group, else
    # the default group); each rank reads and writes its own tensors.
    DCP = "DCP on the group given"
    # Creates the default group (with process_group_backend), an explicit gloo group, or a mesh on the default one.
    CREATES_GROUP = "creates a group by the rule"
    # accelerate's PartialState read or created without a launcher: no process group is made here.
    NO_GROUP = "creates no process group"


# torch.distributed functions that communicate or create groups (the module and its submodules).
TORCH_DISTRIBUTED = {
    "all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "all_gather", "all_gather_into_tensor",
    "all_gather_coalesced", "gather", "scatter", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
    "all_to_all_single", "barrier", "monitored_barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv",
    "all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list", "send_object_list",
    "recv_object_list", "new_group", "new_subgroups", "new_subgroups_by_enumeration", "split_group",
    "init_process_group", "init_device_mesh", "DeviceMesh",
    # DCP and the FSDP state-dict API: object collectives for planning, DTensor gathers for full state dicts.
    "save", "async_save", "load", "get_model_state_dict", "get_optimizer_state_dict", "get_state_dict",
    "set_model_state_dict", "set_optimizer_state_dict", "set_state_dict",
}
# Other callables that communicate: accelerate's state (which creates the default group) and gradient clipping.
OTHER_CALLABLES = {"accelerate.PartialState", "accelerate.state.PartialState", "torch.nn.utils.clip_grad_norm_"}
# Methods that communicate whatever object they are called on.
METHODS = {"full_tensor", "redistribute", "clip_grad_norm_", "wait_for_everyone", "gather_for_metrics",
           "pad_across_processes"}
# accelerate's collectives, when called on an Accelerator.
ACCELERATOR_METHODS = {"gather", "reduce"}

# (file, enclosing function, the call as written) -> why the rule covers it. A call written twice in one function
# is listed twice.
SITES: list[tuple[str, str, str, Cover]] = [
    ("checkpoint/dcp_io.py", "load_dcp", "dcp.load", Cover.DCP),
    ("checkpoint/disk.py", "DiskGuard.check_free_space", "dist.all_gather_object", Cover.OBJECT),
    ("checkpoint/ema_files.py", "ema_model_state", "get_model_state_dict", Cover.MESH_GROUPS),
    ("ema.py", "ModelEMA.swap_into", "average.full_tensor", Cover.MESH_GROUPS),
    ("checkpoint/formats.py", "CheckpointFiles.large_writes", "get_optimizer_state_dict", Cover.MESH_GROUPS),
    ("checkpoint/formats.py", "CheckpointFiles.large_writes", "get_optimizer_state_dict", Cover.MESH_GROUPS),
    ("checkpoint/formats.py", "CheckpointFiles.load", "get_optimizer_state_dict", Cover.MESH_GROUPS),
    ("checkpoint/formats.py", "CheckpointFiles.load", "set_optimizer_state_dict", Cover.MESH_GROUPS),
    ("checkpoint/formats.py", "CheckpointFiles.load", "set_optimizer_state_dict", Cover.MESH_GROUPS),
    ("checkpoint/formats.py", "CheckpointFiles._model_state", "get_model_state_dict", Cover.MESH_GROUPS),
    ("checkpoint/dcp_io.py", "save_dcp", "dcp.save", Cover.DCP),
    ("checkpoint/formats.py", "CheckpointFiles._load_model", "set_model_state_dict", Cover.MESH_GROUPS),
    ("checkpoint/formats.py", "CheckpointFiles._load_model", "set_model_state_dict", Cover.MESH_GROUPS),
    ("checkpoint/manager.py", "_barrier", "dist.barrier", Cover.DEFAULT_GROUP),
    ("checkpoint/manager.py", "CheckpointManager.__init__", "dist.new_group", Cover.CREATES_GROUP),
    ("checkpoint/manager.py", "CheckpointManager._write", "dist.barrier", Cover.HOST_GROUP),
    ("checkpoint/state.py", "gather_rng_states", "dist.all_gather_object", Cover.OBJECT),
    ("distributed/accelerator.py", "_create_process_group", "PartialState", Cover.NO_GROUP),  # no launcher
    ("distributed/accelerator.py", "_create_process_group", "PartialState", Cover.CREATES_GROUP),
    ("distributed/accelerator.py", "_create_process_group", "PartialState", Cover.CREATES_GROUP),
    ("distributed/accelerator.py", "_rehearse_on_cpu", "PartialState", Cover.NO_GROUP),  # the state that exists
    ("distributed/accelerator.py", "_one_rank_mesh", "init_device_mesh", Cover.CREATES_GROUP),
    ("distributed/accelerator.py", "sync_ignored_grads", "torch.distributed.all_reduce", Cover.DEFAULT_GROUP),
    ("distributed/accelerator.py", "sync_found_inf", "torch.distributed.all_reduce", Cover.DEFAULT_GROUP),
    ("distributed/memory.py", "gather_rank_bytes", "dist.all_gather_object", Cover.OBJECT),
    ("distributed/metrics.py", "IntervalMetrics.reduce", "dist.all_reduce", Cover.DEFAULT_GROUP),
    ("distributed/metrics.py", "IntervalMetrics.reduce", "dist.all_reduce", Cover.DEFAULT_GROUP),
    ("evaluation.py", "gather_full_weights", "get_model_state_dict", Cover.MESH_GROUPS),
    ("evaluation.py", "gather_full_weights", "value.full_tensor", Cover.MESH_GROUPS),
    ("evaluation.py", "Evaluator.after_step", "dist.all_gather_object", Cover.OBJECT),
    ("evaluation.py", "Lockstep._agree", "dist.all_reduce", Cover.DEFAULT_GROUP),
    ("launch/placement.py", "record_placement", "dist.all_gather_object", Cover.OBJECT),
    ("launch/preemption.py", "PreemptionWatch.__init__", "dist.new_group", Cover.CREATES_GROUP),
    ("launch/preemption.py", "PreemptionWatch._exchange", "dist.all_reduce", Cover.HOST_GROUP),
    ("launch/run_dir.py", "agree_on_output_dir", "dist.broadcast_object_list", Cover.OBJECT),
    ("step.py", "Stepper._finish_gradients", "acc.clip_grad_norm_", Cover.MESH_GROUPS),
    ("step.py", "Stepper._finish_gradients", "total.full_tensor", Cover.MESH_GROUPS),
    ("train.py", "train", "accelerator.wait_for_everyone", Cover.DEFAULT_GROUP),
]


@dataclass(frozen=True)
class Site:
    file: str
    function: str
    call: str
    node: ast.Call
    resolved: str  # the dotted name the call resolves to through the file's imports ("" for a method)

    @property
    def key(self) -> tuple[str, str, str]:
        return self.file, self.function, self.call

    def keyword(self, name: str) -> ast.expr | None:
        return next((k.value for k in self.node.keywords if k.arg == name), None)


def _imports(tree: ast.Module) -> dict[str, str]:
    """Local name -> the dotted name it imports."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    names[alias.asname] = alias.name
                else:
                    names[alias.name.split(".")[0]] = alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _dotted(node: ast.expr) -> list[str] | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def _is_collective(func: ast.expr, imports: dict[str, str]) -> tuple[bool, str]:
    parts = _dotted(func)
    if parts is not None and parts[0] in imports:  # a module, or a name imported from one
        resolved = ".".join([imports[parts[0]], *parts[1:]])
        if resolved in OTHER_CALLABLES:
            return True, resolved
        in_distributed = resolved.startswith("torch.distributed.")
        return in_distributed and resolved.rsplit(".", 1)[1] in TORCH_DISTRIBUTED, resolved
    if isinstance(func, ast.Attribute):  # a method of an object
        receiver = _dotted(func.value)
        on_accelerator = receiver is not None and receiver[-1] in ("accelerator", "acc")
        return func.attr in METHODS or (on_accelerator and func.attr in ACCELERATOR_METHODS), ""
    return False, ""


class _Collector(ast.NodeVisitor):
    def __init__(self, file: str, imports: dict[str, str]):
        self.file, self.imports, self.scope, self.sites = file, imports, [], []

    def _enter(self, node: ast.AST) -> None:
        self.scope.append(node.name)  # type: ignore[attr-defined]
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _enter

    def visit_Call(self, node: ast.Call) -> None:
        found, resolved = _is_collective(node.func, self.imports)
        if found:
            self.sites.append(Site(self.file, ".".join(self.scope) or "<module>", ast.unparse(node.func), node,
                                   resolved))
        self.generic_visit(node)


def collective_sites(root: Path = PACKAGE) -> list[Site]:
    sites: list[Site] = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        collector = _Collector(path.relative_to(root).as_posix(), _imports(tree))
        collector.visit(tree)
        sites += collector.sites
    return sites


@pytest.fixture(scope="module")
def sites() -> list[Site]:
    return collective_sites()


def _covered(sites: list[Site]) -> dict[tuple[str, str, str], list[tuple[Site, Cover]]]:
    """Each site paired with its table entry, in order of appearance within one key."""
    covers: dict[tuple[str, str, str], list[Cover]] = {}
    for file, function, call, cover in SITES:
        covers.setdefault((file, function, call), []).append(cover)
    paired: dict[tuple[str, str, str], list[tuple[Site, Cover]]] = {}
    for site in sites:
        entries = paired.setdefault(site.key, [])
        entries.append((site, covers[site.key][len(entries)]))
    return paired


def test_every_collective_call_site_is_covered_by_the_rule(sites: list[Site]) -> None:
    found = Counter(site.key for site in sites)
    listed = Counter((file, function, call) for file, function, call, _ in SITES)
    unlisted = sorted((found - listed).elements())
    gone = sorted((listed - found).elements())
    assert not unlisted, (
        f"collective call sites that SITES does not classify: {unlisted}. Check each against docs/launching.md "
        "(Collectives and backends) and add it with the reason it is valid on NCCL")
    assert not gone, f"SITES lists call sites that are no longer in the package: {gone}"


def test_each_site_is_written_the_way_its_reason_says(sites: list[Site]) -> None:
    """The table's reasons are checked against the call: a host-group site passes its group, a default-group tensor
    collective passes none (so it cannot land on a group without the map), and groups are created only with the
    rule's backends."""
    for entries in _covered(sites).values():
        for site, cover in entries:
            group = site.keyword("group") or site.keyword("process_group")
            backend = site.keyword("backend")
            where = f"{site.file}:{site.node.lineno} {site.call} ({cover.value})"
            if cover is Cover.HOST_GROUP:
                assert group is not None, f"{where}: passes no group"
            if cover in (Cover.DEFAULT_GROUP, Cover.OBJECT):
                assert group is None, f"{where}: runs on a group of its own, not the default group"
            if cover is Cover.NO_GROUP:
                assert backend is None and site.resolved.endswith("PartialState"), where
            if cover is Cover.CREATES_GROUP:
                name = site.resolved.rsplit(".", 1)[-1]
                if name == "new_group":  # a host-side group of its own: gloo, CPU tensors only
                    assert isinstance(backend, ast.Constant) and backend.value == CPU_BACKEND, where
                elif name in ("init_device_mesh", "DeviceMesh"):  # inherits the default group's backends
                    assert site.keyword("backend_override") is None, where
                else:  # the default group: the backend map of process_group_backend()
                    assert isinstance(backend, ast.Call) and ast.unparse(backend.func) == "process_group_backend", where


def test_the_collector_finds_what_the_rule_forbids(tmp_path: Path) -> None:
    """The negative control: the collector sees through import aliases, and a group created with another backend
    (a plain NCCL default group, an NCCL side group) is not covered by any reason."""
    (tmp_path / "bad.py").write_text(
        "import torch.distributed as d\n"
        "from torch import distributed\n"
        "from torch.distributed import all_reduce as ar\n"
        "def f(t, accelerator):\n"
        "    d.init_process_group(backend='nccl')\n"
        "    distributed.new_group(backend='nccl')\n"
        "    ar(t)\n"
        "    accelerator.gather(t)\n"
        "    t.full_tensor()\n"
        "    t.sum()\n"
    )
    found = collective_sites(tmp_path)
    assert [(s.call, s.resolved) for s in found] == [
        ("d.init_process_group", "torch.distributed.init_process_group"),
        ("distributed.new_group", "torch.distributed.new_group"),
        ("ar", "torch.distributed.all_reduce"),
        ("accelerator.gather", ""),
        ("t.full_tensor", ""),
    ]
    creations = [s for s in found if s.call.endswith(("init_process_group", "new_group"))]
    for site in creations:
        backend = site.keyword("backend")
        assert not (isinstance(backend, ast.Call) and ast.unparse(backend.func) == "process_group_backend")
        assert not (isinstance(backend, ast.Constant) and backend.value == CPU_BACKEND)


def test_a_gpu_run_maps_cpu_tensors_to_gloo_and_cuda_tensors_to_nccl() -> None:
    assert process_group_backend(cpu=False) == GPU_BACKEND == "cuda:nccl,cpu:gloo"
    assert process_group_backend(cpu=True) == CPU_BACKEND == "gloo"
    # torch's reading of the strings: what each device type's collectives run on.
    assert BackendConfig(Backend(GPU_BACKEND)).get_device_backend_map() == {"cuda": "nccl", "cpu": "gloo"}
    assert BackendConfig(Backend(CPU_BACKEND)).get_device_backend_map() == {"cpu": "gloo", "cuda": "gloo"}
    # What accelerate creates on its own for a GPU run: no CPU entry, so every CPU-tensor collective on it fails.
    assert "cpu" not in BackendConfig(Backend("nccl")).get_device_backend_map()


# One process, one group per backend string, and the all_reduce of a CPU tensor that checkpoint/disk.py used to run.
CPU_TENSOR_SCRIPT = """
import sys, torch, torch.distributed as dist
dist.init_process_group(sys.argv[1])
try:
    dist.all_reduce(torch.ones(1))
    print("accepted")
except RuntimeError as error:
    print("refused:", str(error).splitlines()[0])
dist.destroy_process_group()
"""


@pytest.mark.parametrize(("backend", "outcome"), [
    ("cuda:gloo", "refused: No backend type associated with device type cpu"),
    ("cuda:gloo,cpu:gloo", "accepted"),
], ids=["no_cpu_entry", "cpu_entry"])
def test_a_group_needs_a_cpu_backend_for_a_cpu_tensor(backend: str, outcome: str, tmp_path: Path) -> None:
    """What the rule prevents, on the part a CPU can run: a group whose map has no CPU entry (accelerate's plain
    ``nccl`` group on a GPU is ``{cuda: nccl}``; ``cuda:gloo`` stands in for it here) refuses a CPU tensor, and the
    same group with the map's ``cpu:gloo`` entry takes it."""
    script = tmp_path / "cpu_tensor.py"
    script.write_text(CPU_TENSOR_SCRIPT)
    proc = run_watched([PYTHON, str(script), backend], rank_env(clean_env(), 0, 1, free_port()), tmp_path, 120)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == outcome, proc.stdout[-3000:]
