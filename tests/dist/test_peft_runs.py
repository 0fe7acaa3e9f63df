"""LoRA fine-tuning of a small ACT under 1 process, FSDP-2 and HSDP-2x2, on real gloo process groups.

The base is the FSDP-2 reference run of test_checkpoints (trained once per session): its gathered
model.safetensors for the sharded runs, and its DCP shards converted by lerobot-mg-convert-dcp for the one-process
run (the converter's output equals the gathered file bit for bit, so all three start from the same weights).
All three runs see the same global batches (8 per update) with no dropout and no VAE sampling, so their adapters
must agree up to float summation order.

That the frozen base never changes is checked where a change would show: the optimizer holds adapter state only,
the checkpoints hold the adapter only, and a resumed run, which rebuilds the base from disk and loads only the
adapter, lands bit for bit on the straight run's adapter.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lerobot_mg.checkpoint import layout as L
from lerobot_mg.checkpoint.convert import convert_checkpoint, read_dcp_tensors
from lerobot_mg.data.lerobot_dataset import LeRobotDataset
from lerobot_mg.peft.lora import load_policy
from lerobot_mg.processors import PolicyProcessorPipeline
from tests.dist.test_checkpoints import (
    PRETRAINED_COMMON,
    TRAINING_STATE_COMMON,
    dcp_files,
    file_tree,
    reference_run,
)
from tests.launch_utils import PUSHT_SLICE, TINY_RUN, run_train
from tests.tolerances import assert_same_weights

pytestmark = pytest.mark.dist

STEPS, SAVE_FREQ = 6, 3
LR = 1e-4  # pusht_debug's: the adapters of matched runs are compared with tests/tolerances.py's Adam bounds
# LoRA's A matrices get their gradient only through B, which starts at zero: their first updates act on gradients
# near rounding level, and Adam turns those into full steps. Measured: HSDP-2x2 (micro-batch 2) parts from one
# process in 12/256 entries of one A matrix after 6 updates, FSDP-2 in none; a real error moves most entries.
LORA_FLIPPED_FRACTION = 0.05
LORA = [*TINY_RUN, "peft=lora", "peft.r=4", "peft.full_training_modules=[action_head]", f"steps={STEPS}",
        f"checkpoint.save_freq={SAVE_FREQ}", "log_freq=1", f"optimizer.lr={LR}",
        "policy.l1_reduction=per_sample"]  # layouts compared: each sample weighs the same on every rank
RUNS = {  # name -> (processes, overrides); every run updates on global batches of 8
    "single": (1, ["batch_size=8"]),
    "fsdp2": (2, ["batch_size=4", "parallelism.dp_shard=2", "checkpoint.format=safetensors_dcp"]),
    "hsdp2x2": (4, ["batch_size=2", "parallelism.dp_replicate=2", "parallelism.dp_shard=2", "checkpoint.format=dcp"]),
}


@dataclass(frozen=True)
class Bases:
    gathered: Path  # the reference run's model.safetensors (and its DCP shards)
    converted: Path  # a copy holding only the DCP shards, converted to model.safetensors
    digest: str  # of the gathered weights file, before any fine-tuning


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="session")
def bases(tmp_path_factory: pytest.TempPathFactory) -> Bases:
    gathered = L.checkpoints_root(reference_run(tmp_path_factory, "fsdp2")) / "000010" / "pretrained_model"
    converted = shutil.copytree(gathered, tmp_path_factory.mktemp("converted_base") / "pretrained_model")
    (converted / L.MODEL_SAFETENSORS).unlink()
    return Bases(gathered, converted, _digest(gathered / L.MODEL_SAFETENSORS))


@dataclass(frozen=True)
class LoraRun:
    output_dir: Path
    stdout: str

    def step_dir(self, step: int = STEPS) -> Path:
        return L.checkpoints_root(self.output_dir) / L.step_dir_name(step)

    def adapter(self, step: int = STEPS) -> dict[str, torch.Tensor]:
        pretrained = self.step_dir(step) / L.PRETRAINED_MODEL_DIR
        if (pretrained / L.ADAPTER_SAFETENSORS).is_file():
            return load_file(str(pretrained / L.ADAPTER_SAFETENSORS))
        return read_dcp_tensors(pretrained / L.MODEL_DCP_DIR)

    def start_record(self) -> dict:
        return json.loads((self.output_dir / "ledger.jsonl").read_text().splitlines()[0])



@pytest.fixture(scope="session")
def lora_run(bases: Bases, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201 (a getter)
    root = tmp_path_factory.mktemp("lora")
    finished: dict[str, LoraRun] = {}

    def get(name: str) -> LoraRun:
        if name not in finished:
            nproc, overrides = RUNS[name]
            base = bases.converted if name == "single" else bases.gathered
            if name == "single":  # a dcp-only base is refused (test below), converted it is a base like any
                convert_checkpoint(base)
            proc = run_train([*LORA, *overrides, f"policy.path={base}", f"output_dir={root / name}"], nproc=nproc,
                             timeout=300)
            finished[name] = LoraRun(root / name, proc.stdout)
        return finished[name]

    return get


def _is_trainable(key: str) -> bool:
    return "lora_A" in key or "lora_B" in key or "action_head" in key


@pytest.mark.parametrize("name", list(RUNS))
def test_lora_trains_the_adapter_only(lora_run, bases: Bases, name: str) -> None:  # noqa: ANN001
    run = lora_run(name)
    base = (bases.converted if name == "single" else bases.gathered).resolve()
    assert (f"base model: {base} (LORA r=4 lora_alpha=4 on ['linear1', 'linear2'], full training "
            "['action_head'])") in run.stdout
    model = run.start_record()["facts"]["model"]
    assert model["base_model_path"] == str(base)
    assert 0 < model["trainable_params"] < model["total_params"] / 10

    adapter = run.adapter()
    assert adapter and all(_is_trainable(key) for key in adapter), sorted(adapter)
    assert {t.dtype for t in adapter.values()} == {torch.float32}
    assert any(key.endswith("lora_B.weight") and tensor.abs().max() > 0 for key, tensor in adapter.items())
    state = run.step_dir() / L.TRAINING_STATE_DIR
    if name == "single":
        optimizer_keys = {key.split("/")[1] for key in load_file(str(state / L.OPTIMIZER_STATE))}
    else:
        optimizer_keys = {key.split(".exp_avg")[0].removeprefix("state.")
                          for key in read_dcp_tensors(state / L.OPTIMIZER_DCP_DIR) if key.endswith(".exp_avg")}
    assert optimizer_keys and all(_is_trainable(key) for key in optimizer_keys), sorted(optimizer_keys)
    assert len(optimizer_keys) == len(adapter)
    assert _digest(bases.gathered / L.MODEL_SAFETENSORS) == bases.digest

    pretrained = run.step_dir() / L.PRETRAINED_MODEL_DIR
    if name != "hsdp2x2":  # (its dcp-only checkpoint is converted in test_converter_...)
        assert _dataset_loss(pretrained) < _dataset_loss(base) - 1e-3


def _dataset_loss(pretrained: Path) -> float:
    """The policy's loss on every third frame of the PushT slice (no dropout, no VAE: deterministic), normalised with
    the statistics saved beside it."""
    policy = load_policy(pretrained)
    dataset = LeRobotDataset(str(PUSHT_SLICE), delta_timestamps={"action": [i / 10 for i in range(10)]})
    batch = torch.utils.data.default_collate([dataset[i] for i in range(0, len(dataset), 3)])
    batch = PolicyProcessorPipeline.from_pretrained(pretrained, "policy_preprocessor")(batch)
    with torch.no_grad():
        return float(policy(batch)[0])


def test_sharded_runs_hold_a_shard_of_the_frozen_base(lora_run) -> None:  # noqa: ANN001
    whole = lora_run("single").start_record()["facts"]["rank_bytes"][0]["parameters"]
    for name in ("fsdp2", "hsdp2x2"):
        per_rank = [held["parameters"] for held in lora_run(name).start_record()["facts"]["rank_bytes"]]
        assert len(per_rank) == RUNS[name][0] and all(held < 0.55 * whole for held in per_rank), (per_rank, whole)
        assert f"parameter MiB per rank: [{', '.join(f'{b / 2**20:.2f}' for b in per_rank)}]" in lora_run(name).stdout


@pytest.mark.parametrize("name", ["fsdp2", "hsdp2x2"])
def test_sharded_lora_matches_one_process(lora_run, name: str) -> None:  # noqa: ANN001
    assert_same_weights(lora_run(name).adapter(), lora_run("single").adapter(), STEPS, LR, LORA_FLIPPED_FRACTION)


def test_adapter_checkpoints_in_every_format(lora_run) -> None:  # noqa: ANN001
    adapter_files = {L.ADAPTER_SAFETENSORS, L.ADAPTER_CONFIG_JSON}
    expected = {
        "single": (PRETRAINED_COMMON | adapter_files,
                   TRAINING_STATE_COMMON | {L.OPTIMIZER_PARAM_GROUPS, L.OPTIMIZER_STATE}),
        "fsdp2": (PRETRAINED_COMMON | adapter_files | dcp_files(L.MODEL_DCP_DIR, 2),
                  TRAINING_STATE_COMMON | dcp_files(L.OPTIMIZER_DCP_DIR, 2)),
        "hsdp2x2": (PRETRAINED_COMMON | {L.ADAPTER_CONFIG_JSON} | dcp_files(L.MODEL_DCP_DIR, 4),
                    TRAINING_STATE_COMMON | dcp_files(L.OPTIMIZER_DCP_DIR, 4)),
    }
    keys = set(lora_run("single").adapter())
    for name, (pretrained_files, state_files) in expected.items():
        for step in (SAVE_FREQ, STEPS):
            step_dir = lora_run(name).step_dir(step)
            assert file_tree(step_dir / L.PRETRAINED_MODEL_DIR) == pretrained_files, step_dir
            assert file_tree(step_dir / L.TRAINING_STATE_DIR) == state_files, step_dir
        assert set(lora_run(name).adapter()) == keys  # DCP shards and adapter files: the same keys
        config = json.loads((lora_run(name).step_dir() / L.PRETRAINED_MODEL_DIR / L.ADAPTER_CONFIG_JSON).read_text())
        assert (config["r"], config["lora_alpha"], config["modules_to_save"]) == (4, 4.0, ["action_head"])
        assert Path(config["base_model_name_or_path"]).is_dir()


def test_converter_merges_peft_shards_into_the_adapter_file(lora_run, tmp_path: Path) -> None:  # noqa: ANN001
    step_dir = shutil.copytree(lora_run("fsdp2").step_dir(), tmp_path / "000006")
    pretrained = step_dir / L.PRETRAINED_MODEL_DIR
    gathered = load_file(str(pretrained / L.ADAPTER_SAFETENSORS))
    (pretrained / L.ADAPTER_SAFETENSORS).unlink()

    merged = load_file(str(convert_checkpoint(step_dir, delete_dcp=True)))

    assert merged.keys() == gathered.keys() == set(lora_run("single").adapter())
    for key, tensor in gathered.items():
        assert merged[key].dtype == tensor.dtype and torch.equal(merged[key], tensor), key
    # Base + merged adapter, ready for inference, equals the unmerged peft model.
    batch = {"observation.state": torch.randn(4, 2)}
    torch.testing.assert_close(load_policy(pretrained).predict_action_chunk(batch),
                               load_policy(pretrained, merge_adapter=False).predict_action_chunk(batch),
                               rtol=0, atol=1e-5)


def _resume(run: LoraRun, destination: Path, step: int, extra: list[str], nproc: int) -> LoraRun:
    """Continue ``run`` from its checkpoint ``step`` in a copy, to STEPS."""
    shutil.copytree(run.output_dir, destination, symlinks=True)
    root = L.checkpoints_root(destination)
    for later in root.iterdir():
        if later.name.isdigit() and int(later.name) > step:
            shutil.rmtree(later)
    (root / L.LAST_LINK).unlink()
    (root / L.LAST_LINK).symlink_to(L.step_dir_name(step))
    config = root / L.LAST_LINK / L.PRETRAINED_MODEL_DIR / L.TRAIN_CONFIG_JSON
    proc = run_train(["resume=true", f"config_path={config}", *extra], nproc=nproc, timeout=300)
    assert f"resumed at loop step {step}" in proc.stdout
    return LoraRun(destination, proc.stdout)


def test_resume_is_bit_identical_on_the_same_topology(lora_run, tmp_path: Path) -> None:  # noqa: ANN001
    straight = lora_run("single")
    resumed = _resume(straight, tmp_path / "resumed", SAVE_FREQ, [], nproc=1)
    for key, tensor in straight.adapter().items():
        assert torch.equal(resumed.adapter()[key], tensor), key


def test_resume_reshards_hsdp_shards_to_one_process(lora_run, tmp_path: Path) -> None:  # noqa: ANN001
    resumed = _resume(lora_run("hsdp2x2"), tmp_path / "resharded", SAVE_FREQ,
                      ["parallelism.dp_replicate=1", "parallelism.dp_shard=1", "checkpoint.format=safetensors",
                       "batch_size=8"], nproc=1)
    assert (f"topology changed at resume (step {SAVE_FREQ}): HSDP: 2 replicas x 2 shards (mesh dp_replicate x "
            "dp_shard) -> single process") in resumed.stdout
    assert_same_weights(resumed.adapter(), lora_run("single").adapter(), STEPS, LR, LORA_FLIPPED_FRACTION)


def test_plain_fine_tuning_starts_from_the_base(bases: Bases, tmp_path: Path) -> None:
    proc = run_train([*TINY_RUN, "steps=2", "log_freq=1", f"policy.path={bases.gathered}",
                      f"output_dir={tmp_path / 'run'}"], timeout=180)
    assert f"base model: {bases.gathered.resolve()} (full fine-tuning)" in proc.stdout
    tuned = load_file(str(tmp_path / "run" / "checkpoints" / "last" / "pretrained_model" / L.MODEL_SAFETENSORS))
    base = load_file(str(bases.gathered / L.MODEL_SAFETENSORS))
    assert tuned.keys() == base.keys()
    # Two AdamW updates at lr 1e-4 move a weight by at most ~2e-4; a fresh initialisation would be far off.
    assert max((tuned[k] - base[k]).abs().max().item() for k in base) < 5e-4
    assert any(not torch.equal(tuned[k], base[k]) for k in base)


def test_dcp_only_base_fails_before_start_naming_the_converter(bases: Bases, tmp_path: Path) -> None:
    dcp_only = shutil.copytree(bases.gathered, tmp_path / "pretrained_model")
    (dcp_only / L.MODEL_SAFETENSORS).unlink()
    proc = run_train([*LORA, f"policy.path={dcp_only}", f"output_dir={tmp_path / 'run'}"], check=False, timeout=120,
                     env={"HYDRA_FULL_ERROR": "0"})
    assert proc.returncode == 2, proc.stdout
    assert (f"lerobot-mg-train: error: policy.path={str(dcp_only)!r}: holds DCP shards only (pytorch_model_fsdp_0/, "
            "a checkpoint.format=dcp checkpoint), which load only after conversion. Fix: lerobot-mg-convert-dcp "
            f"checkpoint_dir={dcp_only}, then rerun with the same policy.path") in proc.stdout.splitlines()
    assert not (tmp_path / "run").exists()


def test_bf16_base_trains_under_fsdp_with_mixed_precision(bases: Bases, tmp_path: Path) -> None:
    """The guide's dtype rule: fp32 adapters beside bf16 full-training copies cannot share an FSDP2 unit (without
    mixed precision the run is refused before start: tests/unit/test_peft.py); with it, every trainable parameter
    is upcast to an fp32 master copy while the frozen base stays bf16, sharded."""
    bf16_base = tmp_path / "bf16" / "pretrained_model"
    shutil.copytree(bases.gathered, bf16_base, ignore=shutil.ignore_patterns(L.MODEL_DCP_DIR))
    weights = load_file(str(bf16_base / L.MODEL_SAFETENSORS))
    save_file({key: tensor.to(torch.bfloat16) for key, tensor in weights.items()}, str(bf16_base / L.MODEL_SAFETENSORS))
    run = run_train([*LORA, "steps=2", f"policy.path={bf16_base}", "parallelism.dp_shard=2", "batch_size=4",
                     "accelerator.mixed_precision=bf16", f"output_dir={tmp_path / 'run'}"], nproc=2, timeout=240)
    adapter = load_file(str(L.checkpoints_root(tmp_path / "run") / L.LAST_LINK / L.PRETRAINED_MODEL_DIR
                            / L.ADAPTER_SAFETENSORS))
    assert {tensor.dtype for tensor in adapter.values()} == {torch.float32}  # the full-training copy too
    assert {key for key in adapter if "action_head" in key} == {"base_model.model.model.action_head.weight",
                                                               "base_model.model.model.action_head.bias"}
    base_bytes = sum(tensor.numel() * 2 for tensor in weights.values())
    assert "precision: bf16" in run.stdout
    per_rank = json.loads((tmp_path / "run" / "rank_bytes.json").read_text())
    assert all(held["parameters"] < 0.6 * base_bytes for held in per_rank), (per_rank, base_bytes)
