"""DCP checkpoints of real FSDP2 and HSDP runs, read through the allow-lists: every .metadata the runs write (fp32,
bf16, a background save in the dcp format) reads the same as through torch's reader and names nothing outside the
allow-list, every item's pickle reads, and a payload planted in the model's .metadata, the optimizer's .metadata or
an optimizer byte item is refused by ``lerobot-mg-convert-dcp`` and by ``resume=true`` under torchrun with one line,
the payload never running (tests/unit/test_dcp_safety.py has the negative controls: torch's reader runs it)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from lerobot_mg.checkpoint import layout as L
from lerobot_mg.checkpoint.convert import dcp_tensor_specs, read_dcp_tensors
from lerobot_mg.checkpoint.dcp_io import item_problems
from lerobot_mg.checkpoint.unpickle import METADATA_GLOBALS, read_dcp_metadata
from tests.dist.test_checkpoints import copy_run, reference_run
from tests.dist.test_resume import resume_args
from tests.launch_utils import REPO, TINY_RUN, run_train, shared_by_workers
from tests.unit.test_dcp_safety import globals_in, plant_item, plant_metadata

pytestmark = [pytest.mark.dist, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def async_dcp_bf16_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """FSDP-2 in bf16, weights and optimizer as DCP shards only, saved in the background."""
    with shared_by_workers(tmp_path_factory, "dcp_safety/async_dcp_bf16") as run_dir:
        if not (L.checkpoints_root(run_dir) / L.step_dir_name(4) / L.TRAINING_STATE_DIR / L.TRAINING_STEP).is_file():
            shutil.rmtree(run_dir, ignore_errors=True)
            run_train([*TINY_RUN, "steps=4", "checkpoint.save_freq=2", "log_freq=2", f"output_dir={run_dir}",
                       "parallelism.dp_shard=2", "checkpoint.format=dcp", "checkpoint.async_save=true",
                       "accelerator.mixed_precision=bf16"], nproc=2, timeout=240)
        return run_dir


def test_every_dcp_file_of_real_runs_reads_as_torch_reads_it(tmp_path_factory: pytest.TempPathFactory) -> None:
    runs = [reference_run(tmp_path_factory, "fsdp2"), reference_run(tmp_path_factory, "hsdp2x2_bf16"),
            async_dcp_bf16_run(tmp_path_factory)]
    metadata_files = sorted(path for run in runs for path in L.checkpoints_root(run).glob("0*/*/*/.metadata"))
    assert {path.parent.name for path in metadata_files} == {L.MODEL_DCP_DIR, L.OPTIMIZER_DCP_DIR}
    for path in metadata_files:
        ours, theirs = read_dcp_metadata(path.parent), FileSystemReader(path.parent).read_metadata()
        assert ours.state_dict_metadata == theirs.state_dict_metadata, path
        assert ours.storage_data == theirs.storage_data and ours.planner_data == theirs.planner_data, path
        assert globals_in(path) <= set(METADATA_GLOBALS), path
        assert item_problems(path.parent, ours) == [], path
    for path in metadata_files:  # the weights, read by the converter's reader and by torch's
        if path.parent.name == L.MODEL_DCP_DIR:
            specs = dcp_tensor_specs(read_dcp_metadata(path.parent))
            by_torch = {key: torch.empty(spec.size, dtype=spec.properties.dtype) for key, spec in specs.items()}
            dcp.load(by_torch, storage_reader=FileSystemReader(path.parent), no_dist=True)
            ours_tensors = read_dcp_tensors(path.parent)
            assert ours_tensors.keys() == by_torch.keys()
            assert all(torch.equal(ours_tensors[key], by_torch[key]) for key in by_torch), path


def _one_error_line(output: str, command: str) -> str:
    """The one line the refusal prints (from rank 0 only under torchrun), with no traceback through the package
    (torchrun prints its own when a rank exits non-zero)."""
    lines = [line for line in output.splitlines() if "refused to unpickle" in line]
    assert len(lines) == 1 and f"{command}: error: " in lines[0], output[-4000:]
    # Frames of this package, by its real path (a clone folder may itself be called lerobot_mg).
    assert f'File "{REPO / "lerobot_mg"}/' not in output, output[-4000:]
    return lines[0]


def test_planted_payloads_are_refused_by_the_converter_and_the_resume(tmp_path: Path,
                                                                       tmp_path_factory: pytest.TempPathFactory) -> None:
    run_dir = copy_run(reference_run(tmp_path_factory, "fsdp2"), tmp_path / "planted")
    step_dir = L.checkpoints_root(run_dir) / L.step_dir_name(4)
    model_dir = step_dir / L.PRETRAINED_MODEL_DIR / L.MODEL_DCP_DIR
    optimizer_dir = step_dir / L.TRAINING_STATE_DIR / L.OPTIMIZER_DCP_DIR
    marker = tmp_path / "payload_ran"
    originals = {path: path.read_bytes() for path in [*model_dir.iterdir(), *optimizer_dir.iterdir()]}

    def restore() -> None:
        for path, data in originals.items():
            path.write_bytes(data)

    planted = plant_metadata(model_dir, marker)
    proc = run_train([f"checkpoint_dir={step_dir}"], script=REPO / "scripts" / "convert_dcp.py", timeout=120,
                     check=False)
    assert proc.returncode == 2
    assert _one_error_line(proc.stdout, "lerobot-mg-convert-dcp").startswith(
        f"lerobot-mg-convert-dcp: error: {planted}: refused to unpickle its contents: it names posix.system")
    assert not marker.exists()

    for plant in ("optimizer_metadata", "optimizer_byte_item"):
        restore()
        if plant == "optimizer_metadata":
            planted, what = plant_metadata(optimizer_dir, marker), "its contents"
        else:
            planted, key = plant_item(optimizer_dir, marker, byte_item=True)
            what = f"item {key!r}"
        # HYDRA_FULL_ERROR=0: what a user sees (the test environment asks for tracebacks)
        proc = run_train(resume_args(run_dir, 4), nproc=2, timeout=180, check=False, env={"HYDRA_FULL_ERROR": "0"})
        assert proc.returncode == 2, proc.stdout[-4000:]
        assert f"{planted}: refused to unpickle {what}: it names posix.system" in _one_error_line(proc.stdout,
                                                                                                "lerobot-mg-train")
        assert not marker.exists()
