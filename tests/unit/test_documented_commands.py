"""Every example command in README.md, docs/, the conf/ comments and the scripts' docstrings works as documented.

The commands are extracted from the files, so a newly documented command is covered: each one-process training
command runs for two steps (with overrides appended: two steps, the PushT slice, a tiny model), all of them in one
child process that calls scripts/train.py's entry point once per command (the interpreter and torch start once). A
command that needs several processes, SLURM, the simulation or another run's output is listed in COVERED_BY with the
test that runs it; a documented command that neither runs here nor has such a test fails this test.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from tests.launch_utils import PUSHT_SLICE, PYTHON, REPO, clean_env, kill_tree

# docs/errors.md quotes wrong inputs and error messages, not commands to run: tests/unit/test_bad_inputs.py runs them.
DOCUMENTED = [REPO / "README.md", *sorted(p for p in (REPO / "docs").glob("*.md") if p.name != "errors.md"),
              *sorted((REPO / "conf").rglob("*.yaml")), *sorted((REPO / "scripts").glob("*.py"))]
_COMMAND = re.compile(r"(?:python scripts/\w+\.py|torchrun|accelerate launch|lerobot-mg-[a-z-]+)(?=\s|$)")
_TRAIN = ("python scripts/train.py", "lerobot-mg-train")

# Commands not run here, by the start of the command (the first rule that matches), and the test that runs them.
COVERED_BY: list[tuple[str, str]] = [
    ("torchrun --nproc-per-node=2 $(which lerobot-mg-train) --dataset.repo_id=", "tests/dist/test_guide_commands.py::test_launching"),
    ("python scripts/train.py -m hydra/launcher=slurm", "tests/dist/test_slurm.py::test_each_sweep_job_has_its_own_run_directory"),
    ("torchrun --nnodes=2", "tests/dist/test_local_sweep.py::test_local_sweep_on_two_nodes_runs_each_point_as_its_own_run"),
    ("torchrun --nproc-per-node=4 scripts/train.py policy.path=lerobot/smolvla_base", "tests/dist/test_vla_lora_runs.py::test_the_adapter_alone_trains_and_is_saved_in_lerobots_layout"),
    ("torchrun --nproc-per-node=4 scripts/train.py policy.path=", "tests/dist/test_peft_runs.py::test_sharded_lora_matches_one_process"),
    ("torchrun --nproc-per-node=4 scripts/train.py experiment=aloha_state", "tests/sim/test_eval_during_training.py::test_evaluation_spread_over_the_ranks_equals_one_process"),
    ("torchrun --nproc-per-node=4", "tests/dist/test_layouts.py::test_hsdp_mesh_is_two_replicas_of_two_shards"),
    ("torchrun --nproc-per-node=2 scripts/train.py policy=diffusion", "tests/dist/test_diffusion_layouts.py::test_fsdp_by_size_with_activation_checkpointing_and_dcp_matches_one_process"),
    ("torchrun --nproc-per-node=2 scripts/train.py experiment=pusht_debug_diffusion", "tests/dist/test_diffusion_layouts.py::test_fsdp_by_size_with_activation_checkpointing_and_dcp_matches_one_process"),
    ("torchrun --nproc-per-node=2 scripts/train.py experiment=aloha_pi0_tiny parallelism.dp_shard=2  dataset=mixture",
     "tests/dist/test_mixture_runs.py::test_a_two_robot_mixture_trains_sharded_resumes_bit_exact_and_is_accounted_per_source"),
    ("torchrun --nproc-per-node=2 scripts/train.py parallelism.dp_shard=2 accelerator.compile=true", "tests/unit/test_checkpointing_and_compile.py::test_compiled_units_train_like_eager"),
    ("torchrun --nproc-per-node=2", "tests/dist/test_layouts.py::test_layout_matches_one_process"),
    ("accelerate launch", "tests/dist/test_launchers.py::test_plain_accelerate_launch_trains_like_torchrun"),
    ("lerobot-mg-make-dataset", "tests/sim/test_generate.py::test_make_dataset_command"),
    ("python scripts/make_dataset.py", "tests/sim/test_generate.py::test_make_dataset_command"),
    ("lerobot-mg-eval", "tests/sim/test_evaluate.py::test_eval_command_on_the_expert"),
    ("python scripts/eval.py", "tests/sim/test_evaluate.py::test_eval_command_on_the_expert"),
    ("lerobot-mg-compare", "tests/dist/test_compare_real.py::test_check_resume_is_sample_exact_on_the_same_topology"),
    ("python scripts/compare_runs.py", "tests/dist/test_compare_real.py::test_check_resume_is_sample_exact_on_the_same_topology"),
    ("lerobot-mg-convert-dcp", "tests/unit/test_convert.py::test_arguments_in_both_spellings"),
    ("python scripts/convert_dcp.py", "tests/unit/test_convert.py::test_arguments_in_both_spellings"),
    ("python scripts/bench_", "make bench (scripts/bench_*.py: run with their defaults by `make bench`)"),
    ("python scripts/plan_table.py", "tests/unit/test_memory_plan_vla.py::test_plan_table_script_prints_the_docs_table"),
    ("python scripts/config_table.py", "tests/unit/test_config_table.py::test_the_docs_tables_are_what_conf_gives"),
]
TINY = {
    "act": ["policy.observation_keys=[observation.state]", "policy.chunk_size=10", "policy.n_action_steps=10",
            "policy.dim_model=16", "policy.n_heads=2", "policy.dim_feedforward=32", "policy.n_encoder_layers=1",
            "policy.n_vae_encoder_layers=1", "policy.latent_dim=4", "policy.vision_channels=[4,8]"],
    "diffusion": ["policy.observation_keys=[observation.state]", "policy.n_obs_steps=2", "policy.horizon=8",
                  "policy.n_action_steps=4", "policy.down_dims=[8,16]", "policy.diffusion_step_embed_dim=8"],
}
# What a documented placeholder stands for here: a run of this session (the first one), or the PushT slice.
PLACEHOLDERS = {"outputs/train/...": "<base>", "outputs/train/<run>": "<base>", "<run>": "<base>",
                "/path/to/dataset": str(PUSHT_SLICE)}


def documented_commands() -> list[tuple[str, str]]:
    """(file:line, command) of every example command: backslash continuations joined, comments dropped."""
    found = []
    for path in DOCUMENTED:
        lines = path.read_text().splitlines()
        for number, line in enumerate(lines):
            text = line.lstrip("# ").strip()
            match = _COMMAND.search(text)
            if match is None or (match.start() > 0 and "`" not in text[:match.start()]):
                continue
            command = text[match.start():]
            if "`" in text[:match.start()]:  # inline in prose: up to the closing backtick
                command = command.split("`", 1)[0]
            follow = number + 1
            while command.rstrip().endswith("\\") and follow < len(lines):
                command = command.rstrip()[:-1] + " " + lines[follow].lstrip("# ").strip()
                follow += 1
            command = re.split(r"\s+#\s|\s{2,}\(", command, maxsplit=1)[0].strip()
            found.append((f"{path.relative_to(REPO)}:{number + 1}", command))
    return found


def _covering_test(command: str) -> str | None:
    return next((test for start, test in COVERED_BY if command.startswith(start)), None)


def _runs_here(command: str) -> bool:
    return command.startswith(_TRAIN) and _covering_test(command) is None


def _run_argv(command: str, out: Path, index: int) -> list[str]:
    """The command's overrides, with its placeholders filled in and the two-step tiny-run overrides appended."""
    for placeholder, value in PLACEHOLDERS.items():
        command = command.replace(placeholder, value)
    args = command.split()[2 if command.startswith("python") else 1:]
    resumed = "resume=true" in args
    base = "policy.path=" in command
    policy = "diffusion" if re.search(r"policy=diffusion|experiment=\w*diffusion", command) else "act"
    extra = ["logging.progress_bar=false", "logging.wandb.mode=disabled", "log_freq=1", "eval.n_episodes=0"]
    extra += ["steps=4"] if resumed else ["steps=2", "dataset.name=lerobot", f"dataset.root={PUSHT_SLICE}"]
    if not (resumed or base):
        extra += TINY[policy]
    if "-m" in args:
        extra.append(f"hydra.sweep.dir={out / f'sweep_{index}'}")
    elif not resumed:
        extra.append(f"output_dir={out / f'run_{index}'}")
    return [*args, *extra]


def test_every_documented_command_runs_here_or_names_the_test_that_runs_it() -> None:
    commands = documented_commands()
    assert len(commands) >= 30, commands  # the extraction finds the README's commands
    assert any(command == "python scripts/train.py steps=100 batch_size=16" for _, command in commands)
    uncovered = [(where, command) for where, command in commands
                 if not _runs_here(command) and _covering_test(command) is None]
    assert not uncovered, f"documented commands no test runs: {uncovered}"
    for test in {_covering_test(command) for _, command in commands} - {None}:
        if "::" in test:  # the named test exists
            file, name = test.split("::")
            assert f"def {name}(" in (REPO / file).read_text(), test


def test_documented_training_commands_run_for_two_steps(tmp_path: Path) -> None:
    # Commands that start from another run's output ("<base>") run after the first run, which they start from.
    runs = sorted(dict.fromkeys(command for _, command in documented_commands() if _runs_here(command)),
                  key=lambda command: any(placeholder in command for placeholder in PLACEHOLDERS))
    assert len(runs) >= 8, runs
    jobs = [_run_argv(command, tmp_path, index) for index, command in enumerate(runs)]
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"jobs": jobs, "base": str(tmp_path / "run_0")}))
    proc = subprocess.Popen([PYTHON, "-m", "tests.unit.test_documented_commands", str(plan)], env=clean_env(),
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        stdout, _ = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        raise AssertionError("watchdog: the documented commands ran over 600 s") from None
    results = json.loads((tmp_path / "results.json").read_text()) if (tmp_path / "results.json").is_file() else []
    assert proc.returncode == 0 and len(results) == len(runs), stdout[-6000:]
    failed = [(command, result) for command, result in zip(runs, results) if result != "ok"]
    assert not failed, f"{failed}\n{stdout[-6000:]}"
    # The runs trained: the base's checkpoint, resumed to step 4.
    assert (tmp_path / "run_0" / "checkpoints" / "last" / "pretrained_model" / "model.safetensors").is_file()


def _run_jobs(plan_path: Path) -> None:
    """In the child: scripts/train.py's entry point once per job; "ok" or the failure, to results.json."""
    from lerobot_mg.scripts_entry import train

    plan = json.loads(plan_path.read_text())
    results = []
    for argv in plan["jobs"]:
        sys.argv = ["scripts/train.py", *[arg.replace("<base>", plan["base"]) for arg in argv]]
        try:
            train()
            results.append("ok")
        except SystemExit as stop:  # Hydra and the entry point exit on errors
            results.append("ok" if stop.code in (0, None) else f"exit {stop.code}")
        except Exception as error:  # noqa: BLE001 - reported per command, with the others still run
            results.append(f"{type(error).__name__}: {error}")
        (plan_path.parent / "results.json").write_text(json.dumps(results))


if __name__ == "__main__":
    _run_jobs(Path(sys.argv[1]))
