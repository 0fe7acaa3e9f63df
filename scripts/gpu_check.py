"""The GPU check's driver (scripts/gpu_check.sh runs it; docs/gpu.md): parts in order of importance, each in its own
processes under a time limit, every figure into one JSON file.

    python3 scripts/gpu_check.py --out DIR [--budget-s 430] [--only act_bf16,pi0_bf16]

A part that needs CUDA reports "skipped: no GPU" on a machine without one; a part that would start too close to the
budget's end reports "skipped: time budget". The JSON is rewritten after every part, so a check stopped from outside
still leaves what it measured. Training runs go through ``python -m torch.distributed.run --nproc-per-node=1`` (the
1-rank distributed path) with this file as the trainer (``--trainer``): it runs lerobot_mg's ``train()`` and
records, per rank, whether av or wandb were imported, the peak CUDA memory and, on a GPU, the host syncs of the
first loop steps.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "lerobot_mg" / "data" / "pusht_image_slice"
TINY = ROOT / "lerobot_mg" / "data" / "vla_tiny"
# LeRobot's published training figures (its docs/source/hardware_guide.mdx): 4xH100, batch 32 per GPU, bf16.
LEROBOT_4XH100 = {
    "pi05": {"update_s": 2.548, "samples_per_s_per_gpu": 12.6, "note": "gradient checkpointing, bf16"},
    "smolvla": {"update_s": 0.312, "samples_per_s_per_gpu": 103.0, "note": "bf16"},
    "diffusion": {"update_s": 0.167, "samples_per_s_per_gpu": 192.0, "note": "bf16"},
}
# Dense bf16 peaks (FLOP/s) from the vendors' data sheets, for an MFU the ledger does not report itself.
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12}
# The ledger's per-interval figures this check reports (absent: null).
INTERVAL_KEYS = ("samples_per_s", "samples_per_s_per_device", "dataloading_s", "preprocessing_s", "update_s",
                 "dataloading_s_rank0", "preprocessing_s_rank0", "update_s_rank0", "mfu", "peak_device_memory_gb",
                 "data_frac", "gpu_peak_memory_gb")
STOP_GRACE_S = 10  # what stopping a run at its limit may take (SIGTERM, then SIGKILL; see _stop)
COMMON = ("logging.progress_bar=false", "logging.wandb.mode=disabled", "eval.n_episodes=0")


class Check:
    def __init__(self, out: Path, work: Path, budget_s: float, only: set[str] | None) -> None:
        self.out, self.work, self.only = out, work, only
        self.start = time.monotonic()
        self.deadline = self.start + budget_s
        self.cuda = _cuda_available()
        self.port = 29600
        self.report: dict = {"schema": 1, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                             "budget_s": budget_s, "gpu": self.cuda, "parts": {},
                             "lerobot_published_4xH100_batch32": LEROBOT_4XH100,
                             "carried_wheels": {w.name: w.stat().st_size for w in sorted((ROOT / ".whl").glob("*.whl"))}}
        self.device_name = ""

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def save(self) -> None:
        self.report["wall_s"] = round(time.monotonic() - self.start, 1)
        tmp = self.out / "gpu_check.json.tmp"
        tmp.write_text(json.dumps(self.report, indent=1, default=str))
        tmp.replace(self.out / "gpu_check.json")

    def part(self, name: str, needs_cuda: bool, estimate_s: float, body, cpu_only: bool = False) -> None:
        if self.only is not None and name not in self.only:
            return
        started = time.monotonic()
        if needs_cuda and not self.cuda:
            result = {"status": "skipped: no GPU"}
        elif cpu_only and self.cuda:
            result = {"status": "skipped: a GPU is present (the CUDA parts run instead)"}
        elif self.left() < estimate_s:
            result = {"status": f"skipped: time budget ({self.left():.0f} s left, the part takes about "
                                f"{estimate_s:.0f} s)"}
        else:
            print(f"== {name} (about {estimate_s:.0f} s; {self.left():.0f} s of the budget left)", flush=True)
            try:
                result = body()
                result.setdefault("status", "ok")
            except Exception as error:  # a part's failure is a finding; the next part still runs
                result = {"status": f"failed: {type(error).__name__}: {str(error)[:400]}"}
        result["seconds"] = round(time.monotonic() - started, 1)
        self.report["parts"][name] = result
        print(f"   {name}: {result['status']} ({result['seconds']} s)", flush=True)
        self.save()

    # -- processes -------------------------------------------------------------------------------------------------
    def run(self, name: str, argv: list[str], limit_s: float, env: dict | None = None) -> tuple[int | str, str]:
        """Run ``argv`` in its own process group under ``limit_s`` (and the budget); its output goes to
        work/logs/<name>.log. Returns the exit status (or "timeout") and the output."""
        log = self.work / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        limit = max(5.0, min(limit_s, self.left() - STOP_GRACE_S))  # a stopped run ends inside the budget
        with open(log, "w") as handle:
            process = subprocess.Popen(argv, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT,
                                       env={**os.environ, **(env or {})}, start_new_session=True)
            try:
                status: int | str = process.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                status = "timeout"
                _stop(process)
        return status, log.read_text(errors="replace")

    def torchrun(self, script: list[str]) -> list[str]:
        self.port += 1
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", f"--master-port={self.port}",
                *script]

    def train(self, name: str, overrides: list[str], limit_s: float, sync_steps: int = 0) -> dict:
        """One training run on the 1-rank distributed path; its figures from the ledger and the trainer's report."""
        run_dir = self.work / "runs" / name
        shutil.rmtree(run_dir, ignore_errors=True)
        report = self.work / "runs" / f"{name}.trainer.json"
        env = {"GPU_CHECK_TRAINER_REPORT": str(report), "GPU_CHECK_SYNC_STEPS": str(sync_steps)}
        status, output = self.run(name, self.torchrun([str(Path(__file__)), "--trainer", *COMMON, *overrides,
                                                       f"output_dir={run_dir}"]), limit_s, env)
        result = {"exit": status, **ledger_figures(run_dir)}
        ranks = [json.loads(p.read_text()) for p in sorted(report.parent.glob(f"{report.name}.rank*"))]
        if ranks:
            trainer = ranks[0]
            result["imported_av"] = any(r["imported_av"] for r in ranks)
            result["imported_wandb"] = any(r["imported_wandb"] for r in ranks)
            result["torch_cuda_max_allocated_gb"] = trainer.get("cuda_max_allocated_gb")
            if trainer.get("syncs") is not None:
                result["host_syncs"] = trainer["syncs"]
        result["banner"] = [line.strip() for line in output.splitlines()
                            if re.search(r"topology:|batch:|precision|joint units|activation checkpointing|FLOPs per sample",
                                        line)][:8]
        if status == "timeout":  # the figures are those of the intervals it logged
            result["status"] = f"timeout: stopped after {result.get('intervals', 0)} logged intervals (the part's limit)"
        elif status != 0:
            errors = [line for line in output.splitlines() if re.search(r"Error|error:|Traceback|out of memory", line)]
            result["status"] = f"failed: exit {status}: " + (errors[-1].strip()[:300] if errors else output[-300:])
        if result.get("imported_av") or result.get("imported_wandb"):
            result["status"] = "failed: the run imported av or wandb, which the GPU machine lacks"
        return result

    def plan(self, name: str, overrides: list[str], limit_s: float) -> dict:
        """plan=true for the same layout: the per-rank bytes and the estimates, read from its printout."""
        status, output = self.run(f"{name}_plan", self.torchrun(["scripts/train.py", *COMMON, *overrides, "plan=true"]),
                                  limit_s)
        plan = parse_plan(output)
        if status == "timeout":
            plan["status"] = f"timeout: the plan took over {limit_s:.0f} s"
        elif status != 0:
            errors = [line for line in output.splitlines() if re.search(r"Error|error:", line)]
            plan["status"] = f"failed: exit {status}: " + (errors[-1].strip()[:300] if errors else output[-300:])
        return plan


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def _stop(process: subprocess.Popen) -> None:
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


# -- the ledger ------------------------------------------------------------------------------------------------------
def ledger_figures(run_dir: Path) -> dict:
    """The last segment's figures: loss first -> last, the last interval's timing keys (null where the ledger has
    none), samples/s from the counters where the ledger states none, and the start's facts that matter here."""
    path = run_dir / "ledger.jsonl"
    if not path.is_file():
        return {"ledger": None}
    start, intervals = None, []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("kind") in ("start", "resume"):
            start, intervals = record, []
        elif record.get("kind") == "interval":
            intervals.append(record)
    facts = (start or {}).get("facts") or {}
    figures: dict = {"intervals": len(intervals),
                     "flops_per_sample": facts.get("flops_per_sample", (facts.get("model") or {}).get("flops_per_sample")),
                     "parameters": (facts.get("model") or {}).get("total_params"),
                     "trainable_parameters": (facts.get("model") or {}).get("trainable_params"),
                     "world_size": (facts.get("topology") or {}).get("world_size"),
                     "device_facts": facts.get("device")}
    if not intervals:
        return figures
    first, last = intervals[0], intervals[-1]
    metrics = last.get("metrics") or {}
    figures.update({key: metrics.get(key) for key in INTERVAL_KEYS})
    figures["loss_first"], figures["loss_last"] = (first.get("metrics") or {}).get("loss"), metrics.get("loss")
    figures["last_interval_steps"] = [intervals[-2]["progress"]["step"] if len(intervals) > 1 else 0,
                                      last["progress"]["step"]]
    if len(intervals) > 1:  # the counters' rate over the last interval (the first one holds the warm-up)
        before = intervals[-2]
        seconds = last["wall_time_s"] - before["wall_time_s"]
        samples = last["progress"]["samples_seen"] - before["progress"]["samples_seen"]
        steps = last["progress"]["step"] - before["progress"]["step"]
        if seconds > 0 and steps > 0:
            figures["counters_samples_per_s"] = round(samples / seconds, 3)
            figures["counters_s_per_step"] = round(seconds / steps, 4)
    return figures


def parse_plan(output: str) -> dict:
    mib = r"([0-9.]+) MiB"
    plan: dict = {}
    for key, pattern in (("parameters", r"parameters: ([0-9,]+)\s*$"),
                         ("state_per_rank_mib", r"rank 0 \([^)]*\):.*= " + mib),
                         ("gathered_mib", r"gathered at the peak: " + mib),
                         ("activations_mib", r"activations \(estimate\): " + mib),
                         ("evaluation_copy_mib", r"evaluation copy: " + mib)):
        match = re.search(pattern, output, re.MULTILINE)
        if match:
            plan[key] = int(match.group(1).replace(",", "")) if key == "parameters" else float(match.group(1))
    fit = re.search(r"^\s*((?:does not fit|fit):.*)$", output, re.MULTILINE)
    plan["fit"] = fit.group(1).strip()[:300] if fit else None
    parts = [plan.get(k) for k in ("state_per_rank_mib", "gathered_mib", "activations_mib")]
    if parts[0] is not None:
        plan["planned_peak_gib"] = round(sum(p or 0.0 for p in parts) / 1024, 3)
        plan["planned_peak_gb"] = round(sum(p or 0.0 for p in parts) * 2**20 / 1e9, 3)  # as the ledger's GB
    plan["lines"] = [line.rstrip() for line in output.split("memory plan:", 1)[-1].splitlines()[:14]] \
        if "memory plan:" in output else output.splitlines()[-5:]
    return plan


# -- the parts -------------------------------------------------------------------------------------------------------
def environment(check: Check) -> dict:
    probe = r"""
import importlib, importlib.metadata as md, json, sys
names = ["torch", "accelerate", "transformers", "huggingface_hub", "safetensors", "peft", "numpy", "tokenizers",
         "pyarrow", "pandas", "pillow", "hydra-core", "omegaconf", "antlr4-python3-runtime", "submitit",
         "hydra-submitit-launcher", "diffusers"]
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
info = {"python": sys.version.split()[0], "executable": sys.executable, "versions": {n: version(n) for n in names}}
modules = ["lerobot_mg.scripts_entry", "lerobot_mg.train", "lerobot_mg.policies.act.modeling_act",
           "lerobot_mg.policies.diffusion.modeling_diffusion", "lerobot_mg.policies.pi0.modeling_pi0",
           "lerobot_mg.policies.pi05.modeling_pi05", "lerobot_mg.policies.smolvla.modeling_smolvla",
           "hydra", "omegaconf", "submitit", "hydra_plugins.hydra_submitit_launcher.submitit_launcher", "diffusers"]
failed = {}
for name in modules:
    try:
        importlib.import_module(name)
    except Exception as error:
        failed[name] = f"{type(error).__name__}: {error}"[:300]
info["import_failures"] = failed
info["imported_av"], info["imported_wandb"] = "av" in sys.modules, "wandb" in sys.modules
info["from"] = {n: getattr(sys.modules.get(n), "__file__", None) for n in ("hydra", "diffusers", "torch", "lerobot_mg")}
import torch, torch.distributed as dist
info["torch_cuda"] = torch.version.cuda
info["cuda_available"] = torch.cuda.is_available()
info["gloo_available"], info["nccl_available"] = dist.is_gloo_available(), dist.is_nccl_available()
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    info["device"] = {"name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                      "multiprocessors": p.multi_processor_count, "capability": f"{p.major}.{p.minor}"}
    info["nccl_version"] = ".".join(map(str, torch.cuda.nccl.version()))
print("GPU_CHECK_ENV " + json.dumps(info))
"""
    status, output = check.run("environment", [sys.executable, "-c", probe], 120)
    line = next((raw for raw in output.splitlines() if raw.startswith("GPU_CHECK_ENV ")), None)
    if line is None:
        return {"status": f"failed: exit {status}: {output[-400:]}"}
    info = json.loads(line.removeprefix("GPU_CHECK_ENV "))
    check.device_name = (info.get("device") or {}).get("name", "")
    if info["import_failures"]:
        info["status"] = f"failed: imports: {sorted(info['import_failures'])}"
    elif info["imported_av"] or info["imported_wandb"]:
        info["status"] = "failed: the core imported av or wandb"
    return info


BACKEND_PROBE = r"""
import json, sys
import torch, torch.distributed as dist
from lerobot_mg.config.schema import AcceleratorConfig
from lerobot_mg.distributed.accelerator import build_accelerator, launch_world, launched, prepare
from lerobot_mg.distributed.parallel_dims import ParallelDims

world_size, rank, local_rank = launch_world()
dp_shard = {"ddp": None, "fsdp": 1}[sys.argv[1]]  # the default layout, or parallelism.dp_shard=1
dims = ParallelDims.resolve(1, dp_shard, world_size, rank, local_rank, launched())
accelerator = build_accelerator(AcceleratorConfig(), dims)
devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
mesh = accelerator.torch_device_mesh
groups = {"default": dist.group.WORLD,
          **{f"mesh{i}": g for i, g in enumerate(mesh.get_all_groups() if mesh is not None else [])}}
out = {"layout": dims.describe(), "distributed_type": str(accelerator.distributed_type), "groups": {}}
for name, group in groups.items():
    for device in devices:  # every device type the map names takes a collective
        dist.all_reduce(torch.ones(1, device=device), group=group)
    out["groups"][name] = str(dist.get_backend_config(group))
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
model, optimizer = prepare(accelerator, model, torch.optim.AdamW(model.parameters()), dims)
accelerator.backward(model(torch.ones(4, 8, device=accelerator.device)).sum())
norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
out["prepared"], out["grad_norm"] = type(model).__name__, round(float(norm), 6)
if torch.cuda.is_available():  # what accelerate would have built: a plain NCCL group refuses a CPU tensor
    plain = dist.new_group(backend="nccl")
    try:
        dist.all_reduce(torch.ones(1), group=plain)
        out["plain_nccl_refuses_cpu"] = False
    except RuntimeError:
        out["plain_nccl_refuses_cpu"] = True
dist.destroy_process_group()
print("GPU_CHECK_PROBE " + json.dumps(out), flush=True)
"""


def backend_probe(check: Check) -> dict:
    script = check.work / "backend_probe.py"
    script.write_text(BACKEND_PROBE)
    result: dict = {}
    for layout in ("ddp", "fsdp"):
        status, output = check.run(f"backend_probe_{layout}", check.torchrun([str(script), layout]), 90)
        line = next((raw for raw in output.splitlines() if raw.startswith("GPU_CHECK_PROBE ")), None)
        result[layout] = json.loads(line.removeprefix("GPU_CHECK_PROBE ")) if line else {"exit": status,
                                                                                        "tail": output[-400:]}
    wanted = "cuda:nccl" if check.cuda else "cpu:gloo"
    bad = [layout for layout, probe in result.items() if wanted not in json.dumps(probe.get("groups", {}))]
    if bad:
        result["status"] = f"failed: {bad}: no {wanted} in the process group's backends"
    return result


def throughput(check: Check, name: str, policy: str, overrides: list[str], limit_s: float, *, plan: bool,
               sync_steps: int, published: str | None) -> dict:
    """The plan (VLAs), then the run; its figures beside LeRobot's published ones."""
    result: dict = {"policy": policy}
    started = time.monotonic()
    if plan:
        result["plan"] = check.plan(name, overrides, min(90.0, limit_s / 3))
    if check.cuda or not plan:
        result.update(check.train(name, overrides, limit_s - (time.monotonic() - started), sync_steps))
    elif "status" in result["plan"]:
        result["status"] = f"skipped: no GPU; the plan: {result['plan']['status']}"
    else:
        result["status"] = "skipped: no GPU (the plan ran, on the meta device)"
    fill_derived(result, check.device_name)
    if published:
        result["lerobot_4xH100"] = {"policy": published, **LEROBOT_4XH100[published]}
        ours = result.get("samples_per_s_per_device")
        if ours:
            result["ratio_to_lerobot_samples_per_s_per_gpu"] = round(ours / LEROBOT_4XH100[published]["samples_per_s_per_gpu"], 3)
    return result


def fill_derived(result: dict, device_name: str) -> None:
    """samples/s per device and MFU where the ledger states none (older ledgers): from the counters and the facts."""
    world = result.get("world_size") or 1
    if result.get("samples_per_s") is None and result.get("counters_samples_per_s") is not None:
        result["samples_per_s"] = result["counters_samples_per_s"]
        result["samples_per_s_source"] = "ledger counters"
    if result.get("samples_per_s_per_device") is None and result.get("samples_per_s") is not None:
        result["samples_per_s_per_device"] = round(result["samples_per_s"] / world, 3)
    if result.get("mfu") is None and result.get("flops_per_sample") and result.get("samples_per_s_per_device"):
        peak = next((v for k, v in PEAK_BF16.items() if k in device_name), None)
        if peak:
            result["mfu"] = round(result["flops_per_sample"] * result["samples_per_s_per_device"] / peak, 4)
            result["mfu_source"] = f"computed here against {peak / 1e12:.0f} TFLOP/s"
    if result.get("peak_device_memory_gb") is None:
        result["peak_device_memory_gb"] = result.get("gpu_peak_memory_gb") or result.get("torch_cuda_max_allocated_gb")


def smolvla_folder(check: Check) -> Path:
    """SmolVLM2-500M's architecture (lerobot_mg's offline copy of its config) beside the shipped tiny tokenizer: the
    full-size model with random weights, no Hub."""
    folder = check.work / "smolvlm2_500m_random"
    folder.mkdir(parents=True, exist_ok=True)
    script = ("import sys; from transformers import SmolVLMConfig; "
              "from lerobot_mg.policies.smolvla.vlm import SMOLVLM2_500M_CONFIG; "
              "SmolVLMConfig(**SMOLVLM2_500M_CONFIG).save_pretrained(sys.argv[1])")
    status, output = check.run("smolvlm_folder", [sys.executable, "-c", script, str(folder)], 60)
    if status != 0:
        raise RuntimeError(f"writing the SmolVLM2 config failed: {output[-300:]}")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY / "smolvlm" / name, folder / name)
    return folder


def main_check(check: Check) -> None:
    workers = "num_workers=8" if check.cuda else "num_workers=0"
    data = f"dataset.root={DATA}"
    cams = "policy.observation_keys=[observation.state,observation.image]"
    act = ["experiment=pusht_debug", data, cams, "accelerator=bf16", "batch_size=32", "steps=60", "log_freq=20",
           "checkpoint.save_checkpoint=false", workers, "policy.dim_model=512", "policy.n_heads=8",
           "policy.dim_feedforward=3200", "policy.n_encoder_layers=4", "policy.n_decoder_layers=1",
           "policy.n_vae_encoder_layers=4", "policy.vision_backbone=resnet18", "policy.chunk_size=100",
           "policy.n_action_steps=100"]
    vla = ["dataset=lerobot", data, cams, "accelerator=bf16", "batch_size=32", "steps=30", "log_freq=10",
           "checkpoint.save_checkpoint=false", workers]
    pi0 = ["policy=pi0", "policy.dtype=bfloat16", "policy.gradient_checkpointing=true",
           f"policy.tokenizer_name={TINY / 'paligemma'}", "parallelism.dp_shard=-1", *vla]
    diffusion = ["experiment=pusht_debug_diffusion", data, cams, "accelerator=bf16", "batch_size=32", "steps=60",
                 "log_freq=20", "checkpoint.save_checkpoint=false", workers, "policy.down_dims=[512,1024,2048]",
                 "policy.diffusion_step_embed_dim=128", "policy.horizon=16", "policy.n_action_steps=8"]
    small_act = ["experiment=pusht_debug", data, "batch_size=32", "log_freq=10", workers]

    check.part("environment", False, 10, lambda: environment(check))
    check.part("backend_probe", False, 25, lambda: backend_probe(check))
    # The largest first: whether a 4B-parameter VLA trains on one GPU, and how fast, is what a session most needs.
    check.part("pi0_bf16", False, 150 if check.cuda else 60, lambda: throughput(
        check, "pi0_bf16", "pi0", pi0, 220, plan=True, sync_steps=9, published="pi05"))
    check.part("smolvla_bf16", False, 90 if check.cuda else 40, lambda: throughput(
        check, "smolvla_bf16", "smolvla", ["policy=smolvla", f"policy.vlm_model_name={smolvla_folder(check)}", *vla],
        150, plan=True, sync_steps=9, published="smolvla"))
    check.part("act_bf16", True, 45, lambda: throughput(check, "act_bf16", "act", act, 90, plan=False,
                                                        sync_steps=9, published=None))
    # Without a GPU: the same runs at CPU size, so the rehearsal reads real ledgers into the JSON.
    cpu_size = ["batch_size=4", "steps=4", "log_freq=2", "num_workers=0"]
    check.part("cpu_rehearsal_act", False, 60, cpu_only=True, body=lambda: throughput(
        check, "cpu_act", "act", [*act, *cpu_size], 150, plan=False, sync_steps=0, published=None))
    check.part("cpu_rehearsal_smolvla_tiny", False, 60, cpu_only=True, body=lambda: throughput(
        check, "cpu_smolvla_tiny", "smolvla",
        ["policy=smolvla", f"policy.vlm_model_name={TINY / 'smolvlm'}", "policy.num_vlm_layers=4",
         "policy.resize_imgs_with_padding=[32,32]", "policy.freeze_vision_encoder=false",
         "policy.train_expert_only=false", *vla, "batch_size=2", "steps=4", "log_freq=2", "num_workers=0"], 180,
        plan=False, sync_steps=0, published=None))
    check.part("cpu_rehearsal_diffusion", False, 60, cpu_only=True, body=lambda: throughput(
        check, "cpu_diffusion", "diffusion", ["experiment=pusht_debug_diffusion", data, *cpu_size,
                                              "checkpoint.save_checkpoint=false"], 150, plan=False, sync_steps=0,
        published=None))
    check.part("cpu_rehearsal_dcp_resume", False, 60, cpu_only=True, body=lambda: dcp_resume(
        check, ["experiment=pusht_debug", data, "batch_size=4", "log_freq=10", "num_workers=0"], async_save=False))
    check.part("diffusion_bf16", True, 50, lambda: throughput(check, "diffusion_bf16", "diffusion", diffusion, 120,
                                                              plan=False, sync_steps=9, published="diffusion"))
    check.part("dcp_resume_fsdp", True, 60, lambda: dcp_resume(check, small_act, async_save=False))
    check.part("async_dcp_resume_fsdp", True, 60, lambda: dcp_resume(check, small_act, async_save=True))
    check.part("fp16_fsdp", True, 30, lambda: throughput(
        check, "fp16_fsdp", "act", [*small_act, "steps=40", "parallelism.dp_shard=-1", "accelerator=fp16",
                                    "checkpoint.save_checkpoint=false"], 90, plan=False, sync_steps=0,
        published=None))
    check.part("cpu_offload_fsdp", True, 40, lambda: throughput(
        check, "cpu_offload_fsdp", "act", [*small_act, "steps=40", "parallelism.dp_shard=-1", "accelerator=bf16",
                                           "accelerator.fsdp.cpu_offload=true", "checkpoint.save_checkpoint=false"],
        90, plan=False, sync_steps=0, published=None))
    check.part("compile_ac_fsdp", True, 90, lambda: compiled_like_eager(check, small_act))


def compiled_like_eager(check: Check, overrides: list[str]) -> dict:
    """accelerator.compile (inductor -> Triton) with activation checkpointing under FSDP2 + bf16 trains like eager:
    the losses of the same logged steps agree within bf16's rounding (dropout off: compiled units draw their masks
    from inductor's RNG, not eager's)."""
    same = [*overrides, "steps=40", "parallelism.dp_shard=-1", "accelerator=bf16", "policy.dropout=0",
            "checkpoint.save_checkpoint=false"]
    eager = check.train("eager_fsdp", same, 60)
    compiled = check.train("compile_ac_fsdp", [*same, "accelerator.compile=true",
                                               "accelerator.activation_checkpointing=true"], 120)
    losses = [[(r.get("metrics") or {}).get("loss") for r in _intervals(check.work / "runs" / name)]
              for name in ("eager_fsdp", "compile_ac_fsdp")]
    worst = max((abs(a - b) / abs(b) for a, b in zip(*losses) if a is not None and b), default=None)
    result = {"eager": {k: eager.get(k) for k in ("exit", "counters_s_per_step")},
              "compiled": {k: compiled.get(k) for k in ("exit", "counters_s_per_step")},
              "largest_relative_loss_difference": worst, "tolerance": 5e-2}
    if eager.get("exit") != 0 or compiled.get("exit") != 0 or worst is None or worst > 5e-2:
        result["status"] = f"failed: eager exit {eager.get('exit')}, compiled exit {compiled.get('exit')}, worst {worst}"
    return result


def _intervals(run_dir: Path) -> list[dict]:
    path, intervals = run_dir / "ledger.jsonl", []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a torn last line
            continue
        if record.get("kind") == "interval":
            intervals.append(record)
    return intervals


def dcp_resume(check: Check, overrides: list[str], async_save: bool) -> dict:
    name = "async_dcp" if async_save else "dcp"
    extra = ["parallelism.dp_shard=-1", "checkpoint.format=dcp", "checkpoint.save_freq=10",
             f"checkpoint.async_save={str(async_save).lower()}"]
    first = check.train(f"{name}_first", [*overrides, *extra, "steps=20"], 90)
    config = check.work / "runs" / f"{name}_first" / "checkpoints" / "last" / "pretrained_model" / "train_config.json"
    status, output = check.run(f"{name}_resume", check.torchrun(
        ["scripts/train.py", *COMMON, "resume=true", f"config_path={config}", "steps=40",
         f"checkpoint.async_save={str(async_save).lower()}"]), 90)
    resumed = "resumed" in output
    result = {"first": {k: first.get(k) for k in ("exit", "loss_first", "loss_last", "intervals")},
              "resume_exit": status, "resumed": resumed}
    if first.get("exit") != 0 or status != 0 or not resumed:
        result["status"] = f"failed: first run exit {first.get('exit')}, resume exit {status}, resumed={resumed}"
    return result


def summary(check: Check) -> list[dict]:
    rows = []
    for name, part in check.report["parts"].items():
        if "policy" not in part:
            continue
        plan = part.get("plan") or {}
        rows.append({"part": name, "status": part["status"], "samples_per_s_per_gpu": part.get("samples_per_s_per_device"),
                     "mfu": part.get("mfu"), "update_s": part.get("update_s"),
                     "s_per_step": part.get("counters_s_per_step"),
                     "peak_memory_gb": part.get("peak_device_memory_gb"),
                     "plan_peak_gb": plan.get("planned_peak_gb"),
                     "lerobot_samples_per_s_per_gpu": (part.get("lerobot_4xH100") or {}).get("samples_per_s_per_gpu"),
                     "lerobot_update_s": (part.get("lerobot_4xH100") or {}).get("update_s")})
    return rows


def print_summary(rows: list[dict]) -> None:
    def cell(value, spec):
        return "-" if value is None else format(value, spec)

    print(f"{'part':<28}{'samples/s/GPU':>14}{'MFU':>7}{'update_s':>10}{'s/step':>8}{'peak GB':>9}{'plan GB':>9}"
          f"{'LeRobot 4xH100: s/s/GPU':>25}{'update_s':>9}  status")
    for r in rows:
        print(f"{r['part']:<28}{cell(r['samples_per_s_per_gpu'], '.1f'):>14}{cell(r['mfu'], '.3f'):>7}"
              f"{cell(r['update_s'], '.4f'):>10}{cell(r['s_per_step'], '.3f'):>8}{cell(r['peak_memory_gb'], '.2f'):>9}"
              f"{cell(r['plan_peak_gb'], '.2f'):>9}{cell(r['lerobot_samples_per_s_per_gpu'], '.1f'):>25}"
              f"{cell(r['lerobot_update_s'], '.3f'):>9}  {r['status'][:60]}")


# -- the trainer (under torchrun) --------------------------------------------------------------------------------------
def trainer(argv: list[str]) -> None:
    import atexit
    import collections
    import traceback
    import warnings

    import torch

    sys.path.insert(0, str(ROOT))  # torchrun puts scripts/ first; gpu_check.sh has the root on PYTHONPATH too
    import lerobot_mg.train as train_module
    from lerobot_mg.scripts_entry import train

    report_path = os.environ.get("GPU_CHECK_TRAINER_REPORT")
    sync_steps = int(os.environ.get("GPU_CHECK_SYNC_STEPS", "0")) if torch.cuda.is_available() else 0
    state = {"step": 0, "active": False, "count": 0}
    counts: dict[int, int] = {}
    sources: collections.Counter = collections.Counter()
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if state["active"] and "synchroniz" in str(message):
            state["count"] += 1
            frames = [f for f in traceback.extract_stack()[:-2]
                      if "/torch/" not in f.filename and "warnings" not in f.filename]
            sources[f"{frames[-1].filename.split('site-packages/')[-1]}:{frames[-1].lineno}" if frames else "?"] += 1
        elif not state["active"]:
            shown(message, category, filename, lineno, file, line)

    if sync_steps:
        warnings.showwarning = show
        warnings.simplefilter("always", UserWarning)
        batches = train_module.endless_batches

        def counting_batches(*args, **kwargs):  # steps 2..sync_steps: from one batch to the next, under "warn"
            inner = batches(*args, **kwargs)
            while True:
                if state["active"]:
                    counts[state["step"]] = state["count"]
                torch.cuda.set_sync_debug_mode(0)
                state.update(active=False, count=0)
                batch = next(inner)
                state["step"] += 1
                if 2 <= state["step"] <= sync_steps:
                    state["active"] = True
                    torch.cuda.set_sync_debug_mode("warn")
                yield batch

        train_module.endless_batches = counting_batches

    def write_report() -> None:
        if not report_path:
            return
        rank = os.environ.get("RANK", "0")
        out = {"imported_av": "av" in sys.modules, "imported_wandb": "wandb" in sys.modules,
               "cuda_max_allocated_gb": round(torch.cuda.max_memory_allocated() / 1e9, 3)
               if torch.cuda.is_available() else None,
               "syncs": None if not sync_steps else {
                   "steps_counted": sorted(counts), "per_step": counts, "max_per_step": max(counts.values(), default=0),
                   "total": sum(counts.values()), "sources": dict(sources.most_common(8))}}
        Path(f"{report_path}.rank{rank}").write_text(json.dumps(out))

    atexit.register(write_report)
    sys.argv = [str(ROOT / "scripts" / "train.py"), *argv]
    train()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "/tmp/gpu_check"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/gpu_check_work"))
    parser.add_argument("--budget-s", type=float, default=float(os.environ.get("GPU_CHECK_BUDGET_S", "430")))
    parser.add_argument("--only", default=os.environ.get("GPU_CHECK_ONLY") or None,
                        help="comma-separated part names (environment, backend_probe, act_bf16, ...)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    check = Check(args.out, args.work, args.budget_s, set(args.only.split(",")) if args.only else None)
    check.save()
    try:
        main_check(check)
    finally:
        check.report["summary"] = summary(check)
        check.save()
        with tarfile.open(args.out / "gpu_check_logs.tar.gz", "w:gz") as archive:  # one file: $OUT returns 8 at most
            for path in sorted(args.work.rglob("*")):
                if path.is_file() and (path.suffix in (".log", ".json") or path.name == "ledger.jsonl"
                                       or ".trainer.json" in path.name):
                    archive.add(path, arcname=str(path.relative_to(args.work)))
    print()
    print_summary(check.report["summary"])
    failed = [name for name, part in check.report["parts"].items() if part["status"].startswith("failed")]
    print(f"gpu_check: {len(check.report['parts'])} parts in {check.report['wall_s']} s; failed: {failed or 'none'}; "
          f"JSON: {args.out / 'gpu_check.json'}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--trainer":
        trainer(sys.argv[2:])
    else:
        sys.exit(main())
