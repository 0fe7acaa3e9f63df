"""Every training and conversion command line of LeRobot's multi-GPU guide, as typed there, runs here.

The command lines below are copied from the guide (docs/multi-gpu.md of LeRobot: "Launching", "Batch semantics",
"Sharded training (FSDP)", "HSDP", "PEFT", "Converting DCP checkpoints"). Each is expanded the way a user's shell
would: ``$(which lerobot-train)`` is this package's train entry point (``lerobot-mg-train``), ``lerobot-convert-dcp``
its converter (``lerobot-mg-convert-dcp``), ``${HF_USER}`` a user name, and the dataset ``${HF_USER}/my_dataset`` (the
real PushT slice) is laid out in a temporary LeRobot cache (``HF_LEROBOT_HOME``), the base policy
``${HF_USER}/my_base_policy`` in a temporary huggingface_hub cache (``HF_HOME``). Everything runs offline
(``HF_HUB_OFFLINE=1``) under torchrun with gloo on this host: the 8- and 16-process examples are scaled to 4
processes (``--nproc-per-node=8``, ``--parallelism.dp_shard=8`` become 2, on 2 nodes x 2 for the multi-node one:
two torchrun invocations with ``--nnodes=2`` on 127.0.0.1). The FSDP command runs as typed on 4 processes; with
each of the guide's two wrap flags appended it runs on 2 (``--nproc-per-node=2 --parallelism.dp_shard=2``): what
those runs check is the flag, and a 4-process start costs about twice a 2-process one.

Every flag of a command line is kept. What is appended, after the guide's flags, is what turns a run into a two-step
test: ``--steps=2`` (``--steps=4`` under 4 accumulation steps, the smallest whole optimizer update), a tiny ACT on
the state inputs, no progress bar; ``...`` in the guide is filled with the flags it stands for. The runs with
``--policy.repo_id`` are refused at start-up, offline, with the clear error (the network step of the push), then run
again with ``--policy.push_to_hub=false`` appended; the converter's ``--push_to_hub`` gives its offline error before
merging anything.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.launch_utils import PUSHT_SLICE, PYTHON, clean_env, free_port, kill_tree, run_watched

HF_USER = "me"
BIN = Path(PYTHON).parent
TRAIN_ENTRY = BIN / "lerobot-mg-train"
CONVERT_ENTRY = BIN / "lerobot-mg-convert-dcp"

# --- the guide's command lines, verbatim ---------------------------------------------------------------------------
LAUNCH_TORCHRUN = """torchrun --nproc-per-node=2 $(which lerobot-train) \\
  --dataset.repo_id=${HF_USER}/my_dataset \\
  --policy.type=act \\
  --policy.repo_id=${HF_USER}/my_trained_policy \\
  --output_dir=outputs/train/act_multi_gpu \\
  --job_name=act_multi_gpu \\
  --trackio.enable=true"""
LAUNCH_ACCELERATE = """accelerate launch --num_processes=2 $(which lerobot-train) \\
  --dataset.repo_id=${HF_USER}/my_dataset \\
  --policy.type=act \\
  --policy.repo_id=${HF_USER}/my_trained_policy \\
  --output_dir=outputs/train/act_multi_gpu \\
  --job_name=act_multi_gpu \\
  --trackio.enable=true"""
ACCUMULATION = """torchrun --nproc-per-node=2 $(which lerobot-train) \\
  --batch_size=8 --accelerator.gradient_accumulation.steps=4 ..."""
FSDP = """torchrun --nproc-per-node=4 $(which lerobot-train) \\
  --dataset.repo_id=${HF_USER}/my_dataset \\
  --policy.type=<your_policy> \\
  --parallelism.dp_shard=4 \\
  --accelerator.mixed_precision=bf16 \\
  --output_dir=outputs/train/my_policy_fsdp"""
WRAP_FLAGS = ["""--accelerator.fsdp.wrap_modules='["MyTransformerBlock"]'   # explicit class names""",
              """--accelerator.fsdp.min_num_params=1000000                  # or: wrap every submodule above 1M params"""]
HSDP = """torchrun --nnodes=2 --nproc-per-node=8 ... $(which lerobot-train) \\
  --parallelism.dp_replicate=2 --parallelism.dp_shard=8 ..."""
PEFT = """torchrun --nproc-per-node=4 $(which lerobot-train) \\
  --policy.path=${HF_USER}/my_base_policy \\
  --peft.method_type=LORA --peft.r=16 \\
  --parallelism.dp_shard=4 \\
  --accelerator.mixed_precision=bf16 \\
  --output_dir=outputs/train/my_policy_fsdp_lora"""
CONVERT = """lerobot-convert-dcp --checkpoint_dir=outputs/train/run/checkpoints/005000"""
CONVERT_AND_PUSH = """lerobot-convert-dcp --checkpoint_dir=... --delete_dcp=true --push_to_hub=${HF_USER}/my_policy"""

# --- what turns a command into a two-step test (appended after the guide's flags) --------------------------------
TINY_ACT = ["--policy.observation_keys=[observation.state]", "--policy.chunk_size=10", "--policy.n_action_steps=10",
            "--policy.dim_model=16", "--policy.n_heads=2", "--policy.dim_feedforward=32",
            "--policy.n_encoder_layers=1", "--policy.n_decoder_layers=1", "--policy.n_vae_encoder_layers=1",
            "--policy.latent_dim=4"]
TWO_STEPS = ["--steps=2", "--logging.progress_bar=false", "--logging.wandb.mode=disabled"]
DATASET = [f"--dataset.repo_id={HF_USER}/my_dataset"]  # what the guide's `...` and the PEFT example leave implied
TIMEOUT_S = 600


def expand(typed: str, fill: dict[str, list[str]] | None = None) -> list[str]:
    """The argv a shell runs for ``typed``: continuations joined, comments dropped, ``$(which lerobot-train)`` and
    ``${HF_USER}`` substituted, the launchers bound to this host (127.0.0.1, a free port, torch.distributed.run and
    accelerate's module), ``...`` filled from ``fill`` in order, and the scaled process counts."""
    line = " ".join(part.split("  #")[0].strip() for part in typed.replace("\\\n", " ").splitlines())
    line = line.replace("$(which lerobot-train)", str(TRAIN_ENTRY)).replace("${HF_USER}", HF_USER)
    line = line.replace("<your_policy>", "act")
    line = line.replace("--nproc-per-node=8", "--nproc-per-node=2").replace("--parallelism.dp_shard=8",
                                                                           "--parallelism.dp_shard=2")
    fills = list((fill or {}).values())
    argv: list[str] = []
    for word in shlex.split(line):
        argv += fills.pop(0) if word == "..." else [word]
    assert not fills, f"unused fills for {typed!r}"
    if argv[0] == "torchrun":
        host = [] if any(a.startswith("--rdzv-endpoint") for a in argv) else [
            "--master-addr=127.0.0.1", f"--master-port={free_port()}"]
        return [PYTHON, "-m", "torch.distributed.run", *host, *argv[1:]]
    if argv[:2] == ["accelerate", "launch"]:
        # --multi_gpu: on a CPU-only host accelerate otherwise starts one process (a GPU host needs only the guide's).
        return [PYTHON, "-m", "accelerate.commands.launch", "--multi_gpu", f"--main_process_port={free_port()}",
                "--mixed_precision=no", "--dynamo_backend=no", *argv[2:]]
    if argv[0] == "lerobot-convert-dcp":
        return [str(CONVERT_ENTRY), *argv[1:]]
    raise AssertionError(f"not a guide command: {typed!r}")


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The working directory of the commands (their relative outputs/), with LeRobot's and the Hub's caches."""
    root = tmp_path_factory.mktemp("guide")
    shutil.copytree(PUSHT_SLICE, root / "lerobot_home" / HF_USER / "my_dataset")
    (root / "hf_home").mkdir()
    return root


def env_of(home: Path) -> dict[str, str]:
    env = clean_env({"HF_HUB_OFFLINE": "1", "HF_LEROBOT_HOME": str(home / "lerobot_home"),
                     "HF_HOME": str(home / "hf_home"), "HF_HUB_DISABLE_TELEMETRY": "1",
                     "TRACKIO_DIR": str(home / "trackio")})  # --trackio.enable=true: its local store, here
    env.pop("HF_TOKEN", None)
    env.pop("HYDRA_FULL_ERROR")  # what a user sees: a user error is one line
    return env


def launch(argv: list[str], home: Path) -> subprocess.CompletedProcess:
    return run_watched(argv, env_of(home), home, TIMEOUT_S)


def trained(result: subprocess.CompletedProcess, run_dir: Path, steps: int = 2) -> None:
    assert result.returncode == 0, f"{result.args}\n{result.stdout[-8000:]}"
    assert (run_dir / "checkpoints" / "last").resolve().name == f"{steps:06d}", result.stdout[-4000:]
    assert "Detected call of `lr_scheduler.step()`" not in result.stdout


def refused_offline(result: subprocess.CompletedProcess, repo_id: str) -> None:
    """The push of --policy.repo_id cannot happen offline: one line at start-up, before anything is trained."""
    errors = [line for line in result.stdout.splitlines() if "lerobot-mg-train: error:" in line]
    assert result.returncode != 0 and len(errors) == 1, result.stdout[-6000:]
    assert errors[0].split("error: ", 1)[1].startswith(
        f"policy.repo_id='{repo_id}': HF_HUB_OFFLINE=1 is set, so the upload at the end of training could never "
        "happen. Fix: unset HF_HUB_OFFLINE"), errors[0]
    assert "Traceback" not in result.stdout or "ChildFailedError" in result.stdout, result.stdout[-6000:]


@pytest.mark.parametrize("typed", [LAUNCH_TORCHRUN, LAUNCH_ACCELERATE], ids=["torchrun", "accelerate_launch"])
def test_launching(typed: str, home: Path) -> None:
    run_dir = home / "outputs" / "train" / "act_multi_gpu"
    shutil.rmtree(run_dir, ignore_errors=True)
    refused_offline(launch([*expand(typed), *TWO_STEPS, *TINY_ACT], home), f"{HF_USER}/my_trained_policy")
    assert not (run_dir / "checkpoints").exists()
    result = launch([*expand(typed), *TWO_STEPS, *TINY_ACT, "--policy.push_to_hub=false"], home)
    trained(result, run_dir)
    # The repo, the commit its copy records (this hand-made copy records none) and where it was read.
    assert (f"({HF_USER}/my_dataset (commit unknown), cache: {home / 'lerobot_home' / HF_USER / 'my_dataset'})"
            in result.stdout)
    assert "topology: DDP: 2 replicas" in result.stdout


def test_gradient_accumulation(home: Path) -> None:
    run_dir = home / "outputs" / "train" / "accumulation"
    result = launch([*expand(ACCUMULATION, {"rest": [*DATASET, f"--output_dir={run_dir}"]}),
                     "--steps=4", *TWO_STEPS[1:], *TINY_ACT], home)
    trained(result, run_dir, steps=4)
    assert "batch_size 8 x dp_world_size 2 x grad_accum 4 = effective batch 64" in result.stdout
    assert "the lr schedule is stepped once per loop step on purpose" in result.stdout


def flags(fragment: str) -> list[str]:
    """The flags of a guide fragment (no command), its comment dropped, as a shell splits them."""
    return shlex.split(fragment.split("  #")[0])


# The guide's placeholder class is ACT's own block here, and the tiny ACT's blocks hold about 2k parameters, so the
# size threshold that wraps each of them is 1000 (the guide's 1M would wrap none).
WRAP_HERE = {"wrap_modules": flags(WRAP_FLAGS[0].replace("MyTransformerBlock", "ACTEncoderLayer")),
             "min_num_params": flags(WRAP_FLAGS[1].replace("1000000", "1000"))}


@pytest.mark.parametrize("wrap", [None, *WRAP_HERE], ids=["declared_units", *WRAP_HERE])
def test_sharded_training(wrap: str | None, home: Path) -> None:
    run_dir = home / "outputs" / "train" / "my_policy_fsdp"
    shutil.rmtree(run_dir, ignore_errors=True)
    typed = FSDP if wrap is None else FSDP.replace("--nproc-per-node=4", "--nproc-per-node=2").replace(
        "--parallelism.dp_shard=4", "--parallelism.dp_shard=2")
    extra = WRAP_HERE[wrap] if wrap is not None else []
    # checkpoint_format=dcp (the guide's flag): the shards the conversion commands below merge.
    result = launch([*expand(typed), *extra, *TWO_STEPS, *TINY_ACT, "--checkpoint_format=dcp"], home)
    trained(result, run_dir)
    assert f"topology: FSDP2: {4 if wrap is None else 2} shards" in result.stdout
    if wrap is not None:
        assert "FSDP wrap units (accelerator.fsdp." + wrap in result.stdout, result.stdout[-4000:]


def test_converting_dcp_checkpoints(home: Path) -> None:
    """On the sharded run's last checkpoint (test_sharded_training's): the push gives its offline error before
    merging or deleting anything, then the plain conversion merges."""
    step_dir = home / "outputs" / "train" / "my_policy_fsdp" / "checkpoints" / "000002"
    if not step_dir.is_dir():
        pytest.skip("runs on the checkpoint test_sharded_training writes")
    pushed = launch(expand(CONVERT_AND_PUSH.replace("--checkpoint_dir=...", f"--checkpoint_dir={step_dir}")), home)
    assert pushed.returncode == 2, pushed.stdout[-4000:]
    assert (f"lerobot-mg-convert-dcp: error: push_to_hub={HF_USER}/my_policy: HF_HUB_OFFLINE=1 is set, so the upload "
            "after the merge could never happen. Fix: ") in pushed.stdout
    assert (step_dir / "pretrained_model" / "pytorch_model_fsdp_0").is_dir()
    assert not (step_dir / "pretrained_model" / "model.safetensors").exists()
    converted = launch(expand(CONVERT.replace("outputs/train/run/checkpoints/005000", str(step_dir))), home)
    assert converted.returncode == 0, converted.stdout[-4000:]
    assert (step_dir / "pretrained_model" / "model.safetensors").is_file()


def test_hsdp_on_two_nodes(home: Path) -> None:
    run_dir = home / "outputs" / "train" / "hsdp"
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = []
    for node in (0, 1):
        argv = expand(HSDP, {"launcher": [f"--node-rank={node}", f"--rdzv-endpoint={endpoint}"],
                             "rest": [*DATASET, "--policy.type=act", f"--output_dir={run_dir}"]})
        nodes.append(subprocess.Popen([*argv, *TWO_STEPS, *TINY_ACT], env=env_of(home), cwd=home,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        outputs = [node.communicate(timeout=TIMEOUT_S)[0] for node in nodes]
    except subprocess.TimeoutExpired:
        raise AssertionError(f"watchdog: the two nodes ran over {TIMEOUT_S}s") from None
    finally:
        for node in nodes:
            if node.poll() is None:
                kill_tree(node)
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(out[-4000:] for out in outputs)
    assert "topology: HSDP: 2 replicas x 2 shards" in outputs[0]
    assert (run_dir / "checkpoints" / "last").resolve().name == "000002"


def _base_in_the_hub_cache(home: Path) -> None:
    """``${HF_USER}/my_base_policy`` as huggingface_hub caches a downloaded model repo: the launching run's
    pretrained_model/ under hub/models--<user>--my_base_policy/snapshots/<commit>, refs/main naming the commit."""
    base = home / "outputs" / "train" / "act_multi_gpu" / "checkpoints" / "last" / "pretrained_model"
    repo = home / "hf_home" / "hub" / f"models--{HF_USER}--my_base_policy"
    commit = "0" * 40
    if not repo.is_dir():
        shutil.copytree(base, repo / "snapshots" / commit)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(commit)


def test_peft_on_fsdp(home: Path) -> None:
    if not (home / "outputs" / "train" / "act_multi_gpu" / "checkpoints" / "last").exists():
        pytest.skip("the base is the run test_launching trains")
    _base_in_the_hub_cache(home)
    run_dir = home / "outputs" / "train" / "my_policy_fsdp_lora"
    result = launch([*expand(PEFT), *DATASET, *TWO_STEPS], home)
    trained(result, run_dir)
    assert (run_dir / "checkpoints" / "last" / "pretrained_model" / "adapter_model.safetensors").is_file()
    assert "base model: " in result.stdout and "my_base_policy" in result.stdout
