"""A DCP checkpoint from someone else never runs code: a pickle payload planted in the model's or the optimizer's
``.metadata``, in a byte item or in a tensor item of a ``.distcp`` file is refused by the converter, the pre-resume
check and the loader with one line naming the file and the refused global, and the file the payload would create
does not exist afterwards. Negative controls, in a subprocess: torch's own ``FileSystemReader`` on the same
``.metadata`` or byte item does run the payload (torch reads tensor items with ``weights_only=True``, so the tensor
plant has no control). Checkpoints of every dtype still read the same through the allow-list as through torch,
and no module of the package unpickles anything any other way."""

from __future__ import annotations

import ast
import io
import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

import lerobot_mg
from lerobot_mg.checkpoint import convert
from lerobot_mg.checkpoint.dcp_io import load_dcp
from lerobot_mg.checkpoint.resume import check_resumable
from lerobot_mg.checkpoint.unpickle import METADATA_GLOBALS, RefusedPickle, read_dcp_metadata
from tests.unit.test_checkpoint_layout import Run

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

class Payload:
    """Pickles as a call of ``os.system("touch <marker>")``: unpickling it creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return os.system, (f"touch {self.marker}",)


def sharded_step_dir(tmp_path: Path) -> Path:
    """A checkpoint.format=dcp step directory of a (pretend) sharded run: model and optimizer as DCP shards only,
    written by torch's writer in one process."""
    run = Run(tmp_path / "run")
    step_dir = run.save(4)
    pretrained, training_state = step_dir / "pretrained_model", step_dir / "training_state"
    dcp.save({k: v.clone() for k, v in run.policy.state_dict().items()},
             checkpoint_id=pretrained / "pytorch_model_fsdp_0", no_dist=True)
    dcp.save(get_optimizer_state_dict(run.policy, run.optimizer), checkpoint_id=training_state / "optimizer_0",
             no_dist=True)
    for name in ("pretrained_model/model.safetensors", "training_state/optimizer_state.safetensors",
                 "training_state/optimizer_param_groups.json"):
        (step_dir / name).unlink()
    marker = training_state / "training_step.json"
    info = json.loads(marker.read_text())
    info["facts"]["topology"] = {"dp_replicate": 1, "dp_shard": 2, "world_size": 2}
    marker.write_text(json.dumps(info))
    check_resumable(step_dir)
    return step_dir


def _overwrite(path: Path, offset: int, length: int, payload: bytes) -> None:
    """Replace the ``length`` bytes at ``offset`` with ``payload`` (zero-padded), the file keeping its size."""
    assert len(payload) <= length, (len(payload), length)
    with open(path, "r+b") as file:
        file.seek(offset)
        file.write(payload.ljust(length, b"\0"))


def plant_metadata(dcp_dir: Path, marker: Path) -> Path:
    path = dcp_dir / ".metadata"
    path.write_bytes(pickle.dumps(Payload(marker)))
    return path


def plant_item(dcp_dir: Path, marker: Path, byte_item: bool) -> tuple[Path, str]:
    """Replace a byte item (a raw pickle, which torch.load reads with its legacy loader) or the largest tensor item
    (a torch.save archive whose data.pkl is the payload) of ``dcp_dir``'s shards; returns the file and the key."""
    metadata = FileSystemReader(dcp_dir).read_metadata()
    kind = BytesStorageMetadata if byte_item else TensorStorageMetadata
    index, info = max(((index, info) for index, info in metadata.storage_data.items()
                       if isinstance(metadata.state_dict_metadata[index.fqn], kind)), key=lambda entry: entry[1].length)
    if byte_item:
        payload = pickle.dumps(Payload(marker))
    else:
        archive = io.BytesIO()
        torch.save(Payload(marker), archive)
        payload = archive.getvalue()
    _overwrite(dcp_dir / info.relative_path, info.offset, info.length, payload)
    return dcp_dir / info.relative_path, index.fqn


def _refusal(path: Path, what: str) -> str:
    return rf"^{re.escape(str(path))}: refused to unpickle {what}: it names posix\.system, which a DCP checkpoint " \
           r"never holds and which could run code, so nothing of it was loaded or run\. Fix: [^\n]*$"


def _torch_reads_in_subprocess(dcp_dir: Path, load_bytes: bool) -> subprocess.CompletedProcess:
    """torch's own reader on ``dcp_dir``: its .metadata, or (``load_bytes``) a load of every byte item."""
    code = ("import sys, torch.distributed.checkpoint as dcp\n"
            "from torch.distributed.checkpoint import FileSystemReader\n"
            "from torch.distributed.checkpoint.metadata import BytesStorageMetadata\n"
            "metadata = FileSystemReader(sys.argv[1]).read_metadata()\n"
            "if sys.argv[2] == '1':\n"
            "    state = {k: 0 for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}\n"
            "    dcp.load(state, storage_reader=FileSystemReader(sys.argv[1]), no_dist=True)\n")
    return subprocess.run([sys.executable, "-c", code, str(dcp_dir), "1" if load_bytes else "0"],
                          capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.parametrize("where", ["model", "optimizer"])
def test_a_payload_in_metadata_is_refused_everywhere_and_never_runs(tmp_path: Path, where: str,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    step_dir = sharded_step_dir(tmp_path)
    dcp_dir = step_dir / ("pretrained_model/pytorch_model_fsdp_0" if where == "model" else
                          "training_state/optimizer_0")
    state = ({k: torch.zeros(v.size, dtype=v.properties.dtype)
              for k, v in convert.dcp_tensor_specs(read_dcp_metadata(dcp_dir)).items()})
    marker = tmp_path / "payload_ran"
    path = plant_metadata(dcp_dir, marker)
    message = _refusal(path, "its contents")

    with pytest.raises(RefusedPickle, match=message):  # the pre-resume check
        check_resumable(step_dir)
    with pytest.raises(RefusedPickle, match=message):  # the loader
        load_dcp(state, dcp_dir, no_dist=True)
    if where == "model":  # the converter, through its command line: one line, status 2
        assert convert.main([f"checkpoint_dir={step_dir}"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and re.search(message[1:], err.strip().removeprefix("lerobot-mg-convert-dcp: error: "))
    assert not marker.exists()

    result = _torch_reads_in_subprocess(dcp_dir, load_bytes=False)  # the negative control: the payload is live
    assert marker.exists(), result.stderr


def test_a_payload_in_a_byte_item_is_refused_and_never_runs(tmp_path: Path) -> None:
    step_dir = sharded_step_dir(tmp_path)
    dcp_dir = step_dir / "training_state" / "optimizer_0"
    marker = tmp_path / "payload_ran"
    path, key = plant_item(dcp_dir, marker, byte_item=True)
    message = _refusal(path, f"item {key!r}")

    with pytest.raises(RefusedPickle, match=message):
        check_resumable(step_dir)
    metadata = read_dcp_metadata(dcp_dir)
    state = {k: 0 for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}
    with pytest.raises(RefusedPickle, match=message):
        load_dcp(state, dcp_dir, no_dist=True)
    assert not marker.exists()

    result = _torch_reads_in_subprocess(dcp_dir, load_bytes=True)  # torch's planner: torch.load(weights_only=False)
    assert marker.exists(), result.stderr


def test_a_payload_in_a_tensor_item_is_refused(tmp_path: Path) -> None:
    step_dir = sharded_step_dir(tmp_path)
    dcp_dir = step_dir / "pretrained_model" / "pytorch_model_fsdp_0"
    state = {k: torch.zeros(v.size, dtype=v.properties.dtype)
             for k, v in convert.dcp_tensor_specs(read_dcp_metadata(dcp_dir)).items()}
    marker = tmp_path / "payload_ran"
    path, key = plant_item(dcp_dir, marker, byte_item=False)
    message = _refusal(path, f"item {key!r}")

    with pytest.raises(RefusedPickle, match=message):
        check_resumable(step_dir)
    with pytest.raises(RefusedPickle, match=message):
        load_dcp(state, dcp_dir, no_dist=True)
    with pytest.raises(RefusedPickle, match=message):
        convert.convert_checkpoint(step_dir)
    assert not marker.exists()


def globals_in(path: Path) -> set[tuple[str, str]]:
    """The globals a (trusted) pickle names, read without resolving any."""
    names: set[tuple[str, str]] = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> object:
            names.add((module, name))
            return METADATA_GLOBALS[(module, name)]

    with open(path, "rb") as file:
        Recorder(file).load()
    return names


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_dtype_reads_the_same_through_the_allow_list(tmp_path: Path, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    saved = {"weight": torch.randn(8, 4).to(dtype), "transposed": torch.randn(4, 6).to(dtype).t(),
             "channels_last": torch.randn(1, 2, 3, 3).to(dtype).contiguous(memory_format=torch.channels_last),
             "step": torch.tensor(3.0), "counts": torch.arange(5), "groups": [{"lr": 1e-3, "betas": (0.9, 0.95)}]}
    dcp.save(saved, checkpoint_id=tmp_path, no_dist=True)  # checkpoint_id a Path: StorageMeta keeps a PosixPath
    ours, theirs = read_dcp_metadata(tmp_path), FileSystemReader(tmp_path).read_metadata()
    assert ours.state_dict_metadata == theirs.state_dict_metadata and ours.storage_data == theirs.storage_data
    assert globals_in(tmp_path / ".metadata") <= set(METADATA_GLOBALS)

    loaded = {k: torch.zeros_like(v) for k, v in saved.items() if isinstance(v, torch.Tensor)}
    loaded["groups"] = [{"lr": 0.0, "betas": (0.0, 0.0)}]  # DCP loads into the structure it is given
    load_dcp(loaded, tmp_path, no_dist=True)
    for key, value in saved.items():
        if isinstance(value, torch.Tensor):
            assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), key
    assert loaded["groups"] == saved["groups"]


def test_metadata_that_builds_anything_but_its_records_is_refused(tmp_path: Path) -> None:
    (tmp_path / ".metadata").write_bytes(pickle.dumps({"a": eval}))
    with pytest.raises(RefusedPickle, match=r"it names builtins\.eval"):
        read_dcp_metadata(tmp_path)
    # An allowed class itself as BUILD's target: setting attributes of torch.Size would change every later load.
    build_on_a_class = b"ctorch\nSize\n}(Vx\nK\x01ub."
    (tmp_path / ".metadata").write_bytes(build_on_a_class)
    with pytest.raises(RefusedPickle, match=r"it names the attributes of a builtins\.type"):
        read_dcp_metadata(tmp_path)
    (tmp_path / ".metadata").write_bytes(pickle.dumps(torch.Size([2])))  # allowed, but not metadata
    with pytest.raises(RefusedPickle, match=r"it names a Size instead of DCP Metadata"):
        read_dcp_metadata(tmp_path)


# --- the source --------------------------------------------------------------------------------------------------

# Every way to unpickle: pickle's own (any Unpickler, subclassed or called), numpy's and pandas' pickle paths, torch.load
# opting out of its restriction, and the pickle-compatible libraries.
_UNPICKLING = re.compile(r"pickle\.loads?\(|Unpickler\b|allow_pickle\s*=\s*True|weights_only\s*=\s*False|read_pickle\("
                         r"|\b(?:dill|cloudpickle|joblib|shelve|marshal)\.(?:loads?|open)\(")
_ALLOWED_UNPICKLER = Path(lerobot_mg.__file__).parent / "checkpoint" / "unpickle.py"


def _torch_loads_without_weights_only(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load"
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"):
            weights_only = [kw.value for kw in node.keywords if kw.arg == "weights_only"]
            if not (weights_only and isinstance(weights_only[0], ast.Constant) and weights_only[0].value is True):
                lines.append(node.lineno)
    return lines


def test_no_module_unpickles_outside_the_allow_listed_reader() -> None:
    offenders = []
    for path in sorted(Path(lerobot_mg.__file__).parent.rglob("*.py")):
        text = path.read_text()
        if path != _ALLOWED_UNPICKLER:
            offenders += [f"{path}:{text[:m.start()].count(chr(10)) + 1}: {m.group()}" for m in _UNPICKLING.finditer(text)]
        tree = ast.parse(text)
        offenders += [f"{path}:{line}: torch.load without weights_only=True"
                      for line in _torch_loads_without_weights_only(tree)]
        offenders += [f"{path}:{node.lineno}: from pickle import"
                      for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module in ("pickle", "_pickle")]
    assert offenders == []


def test_the_source_check_finds_what_it_looks_for() -> None:
    assert _UNPICKLING.search("x = pickle.load(f)") and _UNPICKLING.search("pickle.loads(b)")
    assert _UNPICKLING.search("class U(pickle.Unpickler):") and _UNPICKLING.search("torch.load(f, weights_only=False)")
    assert _UNPICKLING.search("dill.loads(b)") and not _UNPICKLING.search("json.loads(b)")
    assert _torch_loads_without_weights_only(ast.parse("torch.load(f)\ntorch.load(f, weights_only=True)")) == [1]
