"""The guide's PEFT command on the big policies, at tiny sizes: LoRA on a pi0 and a SmolVLA base under FSDP-2 and
HSDP-2x2 on real gloo process groups.

Each base is trained for one step by our own train script on the PushT slice (its camera, state and task string):
pi0 with the tiny sizes of LeRobot's fixture (``policy.dimension_overrides``), SmolVLA with the fixture's tiny VLM
folder. pi0 tokenises with PaliGemma's tokenizer, read from huggingface_hub's cache: the test fills a cache of its
own with the fixture's tiny tokenizer under that repo id and runs offline. Every run starts from a folder that holds
the base and names it relative to it (``policy.path=base/...``), as a LeRobot user does, so the adapter records the
base the way LeRobot's PEFT path reads it.

Checked: the adapter alone trains (LoRA keys only, fp32, B moved off zero), the same global batches give the same
adapter under FSDP-2 and HSDP-2x2, a resume lands bit for bit on the straight run, and the saved adapter loads on
its base with peft's ``PeftModel.from_pretrained`` (LeRobot's loading path) to the numbers of our own loader.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import huggingface_hub
import pytest
import torch
from safetensors.torch import load_file

from lerobot_mg.checkpoint import layout as L
from lerobot_mg.data.lerobot_dataset import LeRobotDataset
from lerobot_mg.peft.base import BASE_SHA256_KEY, weights_sha256
from lerobot_mg.peft.lora import load_policy
from lerobot_mg.policies.pi0.modeling_pi0 import PI0Policy
from lerobot_mg.policies.smolvla import SmolVLAPolicy
from lerobot_mg.processors import PolicyProcessorPipeline
from tests import vla_fixtures as vf
from tests.launch_utils import PUSHT_SLICE, run_train, shared_by_workers
from tests.tolerances import assert_same_weights

pytestmark = pytest.mark.dist

STEPS, LR = 2, 1e-4
PALIGEMMA = "google/paligemma-3b-pt-224"
COMMON = [f"dataset.root={PUSHT_SLICE}", "scheduler=constant", "logging.progress_bar=false",
          "logging.wandb.mode=disabled", "log_freq=1", f"optimizer.lr={LR}"]
PI0_TINY = [*[f"policy.dimension_overrides.{section}.{size}={value}"
              for section, sizes in vf.pi_dimension_overrides("pi0_tiny").items() for size, value in sizes.items()],
            "policy.image_resolution=[42,42]", "policy.tokenizer_max_length=16"]
SMOLVLA_TINY = [f"policy.vlm_model_name={vf.FIXTURES / 'smolvla_tiny' / 'tiny_vlm'}",
                "policy.resize_imgs_with_padding=[32,32]", "policy.num_vlm_layers=2"]
BASES = {"pi0": ["policy=pi0", *PI0_TINY], "smolvla": ["policy=smolvla", *SMOLVLA_TINY]}
SMALL = ["policy.chunk_size=4", "policy.n_action_steps=4", "policy.max_state_dim=4", "policy.max_action_dim=4"]
# The modules LeRobot 0.6.1's default targets (regular expressions, declared by each policy) match in the tiny bases.
PROJECTIONS = ["state_proj", "action_in_proj", "action_out_proj", "action_time_mlp_in", "action_time_mlp_out"]
PI0_TARGETS = [*(f"gemma_expert.model.layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "qv"),
               "state_proj", "action_in_proj", "action_out_proj", "action_time_mlp_in", "action_time_mlp_out"]
LORA = {"pi0": [], "smolvla": []}  # both take LeRobot's default regex
LAYOUTS = {  # name -> (processes, overrides); 4 samples per update in both
    "fsdp2": (2, ["batch_size=2", "parallelism.dp_shard=2", "checkpoint.format=safetensors_dcp"]),
    "hsdp2x2": (4, ["batch_size=1", "parallelism.dp_replicate=2", "parallelism.dp_shard=2"]),
}
BASE_DIR = "base/checkpoints/000001/pretrained_model"  # relative to the folder the runs start in


def _hub_cache(root: Path) -> Path:
    """huggingface_hub's cache layout holding the fixture's tiny tokenizer as PaliGemma's (tokenizer files only)."""
    commit = "0" * 40
    repo = root / f"models--{PALIGEMMA.replace('/', '--')}"
    shutil.copytree(vf.FIXTURES / "pi0_tiny" / "tiny_tokenizer", repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return root


@dataclass(frozen=True)
class Workdir:
    """The folder a policy's runs start in: base/ (the base run) and the LoRA runs beside it."""

    path: Path
    env: dict[str, str]

    @property
    def base(self) -> Path:
        return self.path / BASE_DIR

    def adapter_dir(self, run: str, step: int = STEPS) -> Path:
        return L.checkpoints_root(self.path / run) / L.step_dir_name(step) / L.PRETRAINED_MODEL_DIR


@pytest.fixture(scope="session")
def workdir(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201 (a getter)
    made: dict[str, Workdir] = {}

    def get(policy: str) -> Workdir:
        if policy not in made:
            with shared_by_workers(tmp_path_factory, f"vla_lora_{policy}") as path:
                cache = path / "hub"
                env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
                if not (path / BASE_DIR).is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                    path.mkdir(parents=True)
                    _hub_cache(cache)
                    run_train([*COMMON, *BASES[policy], *SMALL, "steps=1", "batch_size=2", "output_dir=base"],
                              env=env, cwd=path, timeout=300)
                made[policy] = Workdir(path, env)
        return made[policy]

    return get


@pytest.fixture(scope="session")
def lora_run(workdir):  # noqa: ANN001, ANN201 (a getter)
    finished: dict[tuple[str, str], str] = {}

    def get(policy: str, layout: str) -> str:
        if (policy, layout) not in finished:
            where = workdir(policy)
            nproc, overrides = LAYOUTS[layout]
            proc = run_train([*COMMON, f"policy.path={BASE_DIR}", "peft.method_type=LORA", "peft.r=4",
                              *LORA[policy], *overrides, f"steps={STEPS}", "checkpoint.save_freq=1",
                              f"output_dir={layout}"], nproc=nproc, env=where.env, cwd=where.path, timeout=420)
            finished[policy, layout] = proc.stdout
        return finished[policy, layout]

    return get


POLICIES = ["pi0", "smolvla"]
BASE_CLASS = {"pi0": "PI0Policy", "smolvla": "SmolVLAPolicy"}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("policy", POLICIES)
def test_the_adapter_alone_trains_and_is_saved_in_lerobots_layout(workdir, lora_run, policy: str,  # noqa: ANN001
                                                                  layout: str) -> None:
    stdout = lora_run(policy, layout)
    where = workdir(policy)
    targets = (SmolVLAPolicy if policy == "smolvla" else PI0Policy)._peft_target_modules
    assert f"base model: {BASE_DIR} (LORA r=4 lora_alpha=4 on {targets}, full training [])" in stdout
    adapter_dir = where.adapter_dir(layout)
    adapter = load_file(str(adapter_dir / L.ADAPTER_SAFETENSORS))
    assert not (adapter_dir / L.MODEL_SAFETENSORS).exists()
    pattern = re.compile(r"base_model\.model\.(model\..+)\.lora_[AB]\.weight")
    adapted = {pattern.fullmatch(key).group(1) for key in adapter}  # (None for a key of another shape: fails)
    expected = ({*(f"model.vlm_with_expert.lm_expert.layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "qv"),
                 *(f"model.{p}" for p in PROJECTIONS)} if policy == "smolvla" else
                {f"model.paligemma_with_expert.{t}" if t.startswith("gemma") else f"model.{t}" for t in PI0_TARGETS})
    assert adapted == expected and len(adapter) == 2 * len(expected)
    assert {tensor.dtype for tensor in adapter.values()} == {torch.float32}
    assert all(tensor.abs().max() > 0 for key, tensor in adapter.items() if "lora_B" in key)  # trained off zero

    config = json.loads((adapter_dir / L.ADAPTER_CONFIG_JSON).read_text())
    assert config["base_model_name_or_path"] == BASE_DIR  # as typed, relative to where training ran: LeRobot's way
    assert config["auto_mapping"]["base_model_class"] == BASE_CLASS[policy]
    assert config["auto_mapping"][BASE_SHA256_KEY] == weights_sha256(where.base)
    assert (config["peft_type"], config["r"], config["inference_mode"]) == ("LORA", 4, True)
    # LeRobot's regex, unchanged (peft full-matches a string)
    assert config["target_modules"] == (SmolVLAPolicy if policy == "smolvla" else PI0Policy)._peft_target_modules
    assert json.loads((adapter_dir / "config.json").read_text())["use_peft"] is True


@pytest.mark.parametrize("policy", POLICIES)
def test_fsdp2_and_hsdp2x2_train_the_same_adapter(lora_run, workdir, policy: str) -> None:  # noqa: ANN001
    for layout in LAYOUTS:
        lora_run(policy, layout)
    where = workdir(policy)
    fsdp2, hsdp = (load_file(str(where.adapter_dir(layout) / L.ADAPTER_SAFETENSORS)) for layout in LAYOUTS)
    assert_same_weights(hsdp, fsdp2, STEPS, LR)


@pytest.mark.parametrize("policy", POLICIES)
def test_resume_lands_on_the_straight_runs_adapter(lora_run, workdir, policy: str) -> None:  # noqa: ANN001
    """From the FSDP-2 run's step-1 checkpoint (adapter file and DCP shards): the base is rebuilt from the recorded
    path, the adapter and its optimizer state read back, and step 2 gives the straight run's adapter to the bit."""
    lora_run(policy, "fsdp2")
    where = workdir(policy)
    copy = where.path / "fsdp2_resumed"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(where.path / "fsdp2", copy, symlinks=True)
    root = L.checkpoints_root(copy)
    shutil.rmtree(root / L.step_dir_name(STEPS))
    (root / L.LAST_LINK).unlink()
    (root / L.LAST_LINK).symlink_to(L.step_dir_name(1))
    config = root / L.LAST_LINK / L.PRETRAINED_MODEL_DIR / L.TRAIN_CONFIG_JSON
    proc = run_train(["resume=true", f"config_path={config}"], nproc=LAYOUTS["fsdp2"][0], env=where.env,
                     cwd=where.path, timeout=420)
    assert "resumed at loop step 1" in proc.stdout
    straight = load_file(str(where.adapter_dir("fsdp2") / L.ADAPTER_SAFETENSORS))
    resumed = load_file(str(where.adapter_dir("fsdp2_resumed") / L.ADAPTER_SAFETENSORS))
    assert straight.keys() == resumed.keys()
    for key, tensor in straight.items():
        assert torch.equal(resumed[key], tensor), key


@pytest.mark.parametrize("policy", POLICIES)
def test_the_adapter_loads_with_peft_on_its_base(lora_run, workdir, policy: str,  # noqa: ANN001
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from peft import PeftModel

    lora_run(policy, "fsdp2")
    where = workdir(policy)
    monkeypatch.chdir(where.path)  # where PEFT and LeRobot read the relative base_model_name_or_path
    for key, value in where.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", where.env["HF_HUB_CACHE"])
    adapter_dir = where.adapter_dir("fsdp2")
    base = load_policy(Path(BASE_DIR))
    with_peft = PeftModel.from_pretrained(base, str(adapter_dir))  # the path recorded in adapter_config.json
    with_peft.eval()
    ours = load_policy(adapter_dir)  # our loader: base + adapter merged into the weights
    plain = load_policy(Path(BASE_DIR))

    dataset = LeRobotDataset(str(PUSHT_SLICE), delta_timestamps={"action": [i / 10 for i in range(4)]})
    batch = torch.utils.data.default_collate([dataset[i] for i in range(0, len(dataset), 60)])
    batch = PolicyProcessorPipeline.from_pretrained(adapter_dir, "policy_preprocessor")(batch)
    batch["sample_seed"] = torch.arange(len(batch["action"]))
    with torch.no_grad():
        losses = [float(model(batch)[0]) for model in (with_peft, ours, plain)]
    assert abs(losses[0] - losses[1]) < 1e-6, losses
    assert losses[0] != losses[2]  # the adapter changes the policy
