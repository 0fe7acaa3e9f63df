#!/usr/bin/env bash
# GPU check (not part of CI): what only a GPU can show. About 10 minutes on one GPU.
#
#   bash scripts/gpu_check.sh            # needs a CUDA torch in .venv or on the PATH's python
#
# 1. The distributed code on one GPU. Under torchrun one process takes the distributed path: the default layout is
#    DDP on a 1-rank NCCL process group (DDP's reducer included), a typed parallelism.dp_shard is FSDP2 on a 1-rank
#    mesh. A probe checks the process group's backend map (cuda:nccl,cpu:gloo, inherited by the device mesh) with a
#    CPU and a CUDA collective on each group, and that a plain NCCL group refuses the CPU tensor (the failure the map
#    prevents). Runs: DDP, FSDP2 with cpu_offload (CPU DTensor gradient norms over the gloo half of the map), DCP
#    shards and a resume, an asynchronous DCP save and a resume. The end of the output lists the paths taken and
#    what only 2+ GPUs can show.
# 2. bf16 and fp16 on CUDA (fp16 builds accelerate's own GradScaler on the GPU).
# 3. accelerator.fsdp.cpu_offload=true with pinned host memory.
# 4. Peak GPU memory of each run (torch.cuda.max_memory_allocated, printed by the inline probe below).
# 5. accelerator.compile (inductor -> Triton) and accelerator.activation_checkpointing on CUDA: Diffusion at
#    LeRobot's U-Net widths, one GPU and FSDP2 on NCCL (units by size), compiled + checkpointed against eager (the
#    losses of the same logged steps must agree); ACT the same under FSDP2 + bf16.
# 6. checkpoint.async_save=true with NCCL as the main group (the background DCP write goes through a gloo side
#    group), and a resume from it; the in-place DCP reader then reads into CUDA targets.
# 7. plan=true against the GPU's free memory (torch.cuda.mem_get_info), and the per-run data wait (data_frac) with
#    uint8 images scaled on the GPU.
# 8. Host syncs per loop step: a short ACT run (one GPU, then FSDP2 on NCCL) under
#    torch.cuda.set_sync_debug_mode("warn"), counting the synchronising CUDA calls of each loop step; a step that
#    neither logs nor saves should have none (`bash scripts/gpu_check.sh sync` runs this part alone).
# 9. LeRobot's ACT with its ResNet18 camera backbone (frozen batch norm) on CUDA, under FSDP2 on NCCL, with the EMA
#    and the validation loss on a held-out episode every 10 steps (the evaluation gathers the weights over NCCL).
# 10. Full-size pi0 (4,028,019,472 parameters) in bf16 on one GPU through the 1-rank distributed path: FSDP2 on a
#    1-rank mesh with its 18 joint-layer units, LeRobot's bfloat16 build (policy.dtype=bfloat16: vision, projector
#    and norms float32) under bf16 mixed precision, random weights (no download; the shipped tiny tokenizer stands
#    in for PaliGemma's gated one). The plan for that layout first, then 10 steps; the peak GPU memory the ledger
#    records (gpu_peak_memory_gb) is printed beside the plan's per-rank total.
# Each run prints, from its ledger: loss first -> last, samples/s of the last interval, data_frac, and the training
# state per rank (rank_bytes.json), plus its checkpoint log lines (bytes and seconds per save).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
DATA=${DATA:-lerobot_mg/data/pusht_image_slice}
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export OMP_NUM_THREADS=4 WANDB_MODE=disabled

$PY - <<'PY'
import torch, torch.distributed as dist
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0))
print("nccl available:", dist.is_nccl_available(), "nccl version:", torch.cuda.nccl.version())
PY

sync_check() {  # name, launcher...: syncs per loop step, from the trainer run in-process under the sync debug mode
  echo "== host syncs per loop step: $1"; shift
  "$@" experiment=pusht_debug "dataset.root=$DATA" steps=30 log_freq=10 \
      checkpoint.save_freq=20 logging.progress_bar=false "output_dir=$OUT/sync_run_$RANDOM" 2>&1 \
      | grep -E "^   |Error" || true
}
SYNC_PROBE=$(mktemp --suffix=.py)
cat > "$SYNC_PROBE" <<'PY'
import collections, os, sys, traceback, warnings
import torch
import lerobot_mg.train as train_module
from lerobot_mg.checkpoint.manager import CheckpointManager
from lerobot_mg.scripts_entry import train

state = {"step": 0, "active": False, "count": 0}
counts, sources = {}, collections.Counter()
_show = warnings.showwarning


def show(message, category, filename, lineno, file=None, line=None):
    if state["active"] and "synchroniz" in str(message):
        state["count"] += 1
        frames = [f for f in traceback.extract_stack()[:-2] if "/torch/" not in f.filename and "warnings" not in f.filename]
        sources[f"{frames[-1].filename.split('site-packages/')[-1]}:{frames[-1].lineno}" if frames else "?"] += 1
    elif not state["active"]:
        _show(message, category, filename, lineno, file, line)


warnings.showwarning = show
warnings.simplefilter("always")
_batches = train_module.endless_batches


def end_step():
    if state["step"]:
        counts[state["step"]] = state["count"]
    state.update(active=False, count=0)


def counting_batches(*args, **kwargs):
    inner = _batches(*args, **kwargs)
    while True:
        end_step()
        torch.cuda.set_sync_debug_mode(0)
        batch = next(inner)
        state["step"] += 1
        state["active"] = True
        torch.cuda.set_sync_debug_mode("warn")
        yield batch


_close = CheckpointManager.close


def close(self):
    torch.cuda.set_sync_debug_mode(0)
    end_step()
    if self.dims.is_main_process:
        quiet = {s: n for s, n in counts.items() if s % 10 and s % 20 and s != max(counts) and s > 1}
        print(f"   rank 0: syncs on loop step 1 (warm-up): {counts.get(1)}; on the {len(quiet)} steps that neither log "
              f"nor save: max {max(quiet.values(), default=0)}, total {sum(quiet.values())}; on log/save steps: "
              f"{ {s: n for s, n in counts.items() if s not in quiet and s > 1} }", flush=True)
        for where, n in sources.most_common(8):
            print(f"   {n:5d}  {where}", flush=True)
    _close(self)


train_module.endless_batches = counting_batches
CheckpointManager.close = close
train()
PY
if [ "${1:-}" = sync ]; then
  sync_check "one GPU" $PY "$SYNC_PROBE"
  sync_check "FSDP2 on NCCL" $PY -m torch.distributed.run --nproc-per-node=1 --master-port=29556 "$SYNC_PROBE" \
      parallelism.dp_shard=-1
  exit 0
fi

common=(experiment=pusht_debug "dataset.root=$DATA" steps=40 batch_size=32 log_freq=10 logging.progress_bar=false
        policy.dim_model=512 policy.n_heads=8 policy.dim_feedforward=2048 policy.observation_keys='[observation.state,observation.image]')

diffusion=(experiment=pusht_debug_diffusion "dataset.root=$DATA" steps=40 batch_size=64 log_freq=10
           logging.progress_bar=false policy.down_dims='[512,1024,2048]' policy.diffusion_step_embed_dim=128
           policy.horizon=16 policy.n_action_steps=8 policy.observation_keys='[observation.state,observation.image]')

run() {  # name, launcher..., overrides... (the ACT overrides in `common` unless PRESET names another array)
  local name=$1; shift
  local -n preset=${PRESET:-common}
  echo "== $name"
  local start=$SECONDS
  "$@" "${preset[@]}" "output_dir=$OUT/$name" > "$OUT/$name.log" 2>&1 || echo "   exit status $?"
  grep -E "topology|batch:|precision|activation checkpointing:|torch.compile:|wrap units|Checkpoint |Error|error" \
      "$OUT/$name.log" || true
  $PY - "$OUT/$name" <<'PY'
import json, sys, pathlib
run = pathlib.Path(sys.argv[1])
from lerobot_mg.accounting.ledger import read_ledger
intervals = read_ledger(run).intervals
first, last = intervals[0], intervals[-1]
before = intervals[-2] if len(intervals) > 1 else None
rate = ((last.progress.samples_seen - before.progress.samples_seen) / (last.wall_time_s - before.wall_time_s)
        if before is not None else float("nan"))
held = json.loads((run / "rank_bytes.json").read_text()) if (run / "rank_bytes.json").exists() else []
print(f"   loss {first.metrics['loss']:.4f} -> {last.metrics['loss']:.4f}, samples/s {rate:.0f}, "
      f"data_frac {last.metrics.get('data_frac', float('nan')):.3f}, training state per rank "
      f"{[round(h['total'] / 2**20, 1) for h in held]} MiB")
PY
  echo "   wall ${SECONDS}s total so far (started at ${start}s)"
}

TR=($PY -m torch.distributed.run --nproc-per-node=1 --master-port=29555 scripts/train.py)
COVERED=()
covered() {  # what, test...: records whether a distributed path was taken (the test succeeds) for the summary
  local what=$1; shift
  if "$@" >/dev/null 2>&1; then COVERED+=("  ok       $what"); else COVERED+=("  MISSING  $what"); fi
}
ONE_RANK_FSDP="topology: FSDP2: 1 shard (a 1-rank mesh)"

BACKEND_PROBE=$(mktemp --suffix=.py)
cat > "$BACKEND_PROBE" <<'PY'
import sys
import torch, torch.distributed as dist
from lerobot_mg.config.schema import AcceleratorConfig
from lerobot_mg.distributed.accelerator import build_accelerator, launch_world, launched, prepare
from lerobot_mg.distributed.parallel_dims import ParallelDims

world_size, rank, local_rank = launch_world()
dp_shard = {"ddp": None, "fsdp": 1}[sys.argv[1]]  # the default layout, or parallelism.dp_shard=1
dims = ParallelDims.resolve(1, dp_shard, world_size, rank, local_rank, launched())
accelerator = build_accelerator(AcceleratorConfig(), dims)
print("   layout:", dims.describe(), "| distributed type:", accelerator.distributed_type)
devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
mesh = accelerator.torch_device_mesh
groups = {"default group": dist.group.WORLD,
          **{f"mesh group {i}": g for i, g in enumerate(mesh.get_all_groups() if mesh is not None else [])}}
for name, group in groups.items():
    for device in devices:  # every device type the map names takes a collective
        value = torch.ones(1, device=device)
        dist.all_reduce(value, group=group)
    print(f"   {name}: backends {dist.get_backend_config(group)}, all_reduce ok on {devices}")
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
model, optimizer = prepare(accelerator, model, torch.optim.AdamW(model.parameters()), dims)
accelerator.backward(model(torch.ones(4, 8, device=accelerator.device)).sum())
norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
print(f"   prepared model: {type(model).__name__}, one backward, gradient norm {float(norm):.4f}")
if torch.cuda.is_available():  # what accelerate would have built: a plain NCCL group
    plain = dist.new_group(backend="nccl")
    try:
        dist.all_reduce(torch.ones(1), group=plain)
        print("   UNEXPECTED: a plain nccl group took a CPU tensor")
    except RuntimeError as error:
        print("   a plain nccl group refuses a CPU tensor, as expected:", str(error).splitlines()[0][:100])
dist.destroy_process_group()
print("   probe done")
PY
for layout in ddp fsdp; do
  echo "== process group of one launched process, $layout (probe)"
  $PY -m torch.distributed.run --nproc-per-node=1 --master-port=29557 "$BACKEND_PROBE" $layout 2>&1 \
      | tee "$OUT/backend_probe_$layout.log" | grep -E "^   |Error" || true
done
covered "process group cuda->nccl, cpu->gloo, inherited by the 1-rank mesh; CPU and CUDA collectives on each (probe)" \
    bash -c "grep -q 'probe done' '$OUT/backend_probe_fsdp.log' && grep 'default group: backends' '$OUT/backend_probe_fsdp.log' \
             | grep -q 'cpu:gloo' && grep 'default group: backends' '$OUT/backend_probe_fsdp.log' | grep -q 'cuda:nccl'"
covered "prepare() wraps DDP on one GPU and FSDP2 on the 1-rank mesh (probe)" \
    bash -c "grep -q 'prepared model: DistributedDataParallel' '$OUT/backend_probe_ddp.log' && grep -q 'prepared model: FSDP' '$OUT/backend_probe_fsdp.log'"

run fp32_single      $PY scripts/train.py
run bf16_single      $PY scripts/train.py accelerator.mixed_precision=bf16
run fp16_single      $PY scripts/train.py accelerator.mixed_precision=fp16
run ddp_nccl         "${TR[@]}"
covered "DDP on a 1-rank NCCL process group (torchrun, default layout)" \
    bash -c "grep -q 'topology: DDP: 1 replica (a 1-rank process group)' '$OUT/ddp_nccl.log' && test -f '$OUT/ddp_nccl/placement.json' && test -f '$OUT/ddp_nccl/rank_bytes.json'"
run fsdp_bf16_nccl   "${TR[@]}" parallelism.dp_shard=-1 accelerator.mixed_precision=bf16
run fsdp_fp16_nccl   "${TR[@]}" parallelism.dp_shard=-1 accelerator.mixed_precision=fp16
covered "FSDP2 on a 1-rank mesh, bf16 and fp16 (loss scaler) on NCCL" \
    bash -c "grep -q '$ONE_RANK_FSDP' '$OUT/fsdp_bf16_nccl.log' && grep -q '$ONE_RANK_FSDP' '$OUT/fsdp_fp16_nccl.log' && test -f '$OUT/fsdp_fp16_nccl/rank_bytes.json'"
run fsdp_offload     "${TR[@]}" parallelism.dp_shard=-1 accelerator.mixed_precision=bf16 accelerator.fsdp.cpu_offload=true
covered "FSDP2 with accelerator.fsdp.cpu_offload=true: CPU DTensor norms and gathers on the map's gloo" \
    bash -c "grep -q '$ONE_RANK_FSDP' '$OUT/fsdp_offload.log' && test -f '$OUT/fsdp_offload/rank_bytes.json' && test -f '$OUT/fsdp_offload/checkpoints/last/pretrained_model/model.safetensors'"
run fsdp_dcp_resume0 "${TR[@]}" parallelism.dp_shard=1 checkpoint.format=dcp steps=20
echo "== resume from DCP on NCCL"
"${TR[@]}" resume=true "config_path=$OUT/fsdp_dcp_resume0/checkpoints/last/pretrained_model/train_config.json" steps=40 \
    > "$OUT/fsdp_dcp_resume1.log" 2>&1 || true
grep -E "resumed|Error" "$OUT/fsdp_dcp_resume1.log" || true
covered "checkpoint.format=dcp: shards written by the 1-rank mesh, and a resume from them" \
    bash -c "test -f '$OUT/fsdp_dcp_resume0/checkpoints/000020/pretrained_model/pytorch_model_fsdp_0/__0_0.distcp' && test -f '$OUT/fsdp_dcp_resume0/checkpoints/000040/training_state/optimizer_0/__0_0.distcp' && grep -q 'resumed' '$OUT/fsdp_dcp_resume1.log'"

run fsdp_async_dcp  "${TR[@]}" parallelism.dp_shard=-1 checkpoint.format=dcp checkpoint.async_save=true \
    checkpoint.save_freq=10 steps=20
echo "== resume from an asynchronously written DCP checkpoint on NCCL"
"${TR[@]}" resume=true "config_path=$OUT/fsdp_async_dcp/checkpoints/last/pretrained_model/train_config.json" steps=40 \
    checkpoint.async_save=true > "$OUT/fsdp_async_dcp_resume.log" 2>&1 || true
grep -E "resumed|Checkpoint |Error" "$OUT/fsdp_async_dcp_resume.log" || true
covered "checkpoint.async_save=true: DCP staged in host memory, written through the gloo side group, resumed" \
    bash -c "grep -q 'staged in host memory' '$OUT/fsdp_async_dcp.log' && grep -q 'resumed' '$OUT/fsdp_async_dcp_resume.log' && test -f '$OUT/fsdp_async_dcp/checkpoints/000040/training_state/optimizer_0/__0_0.distcp'"
echo "== plan=true against the GPU's free memory"
"${TR[@]}" "${common[@]}" parallelism.dp_shard=-1 plan=true "output_dir=$OUT/plan" 2>&1 | tail -n 15

same_losses() {  # run, reference, tolerance: the compiled / checkpointed run trains like the eager one
  $PY - "$OUT/$1" "$OUT/$2" "$3" <<'PY'
import sys, pathlib
from lerobot_mg.accounting.ledger import read_ledger
runs = [[interval.metrics["loss"] for interval in read_ledger(pathlib.Path(d)).intervals] for d in sys.argv[1:3]]
worst, tolerance = max(abs(a - b) / abs(b) for a, b in zip(*runs)), float(sys.argv[3])
print(f"   {pathlib.Path(sys.argv[1]).name} vs {pathlib.Path(sys.argv[2]).name}: largest relative loss difference "
      f"{worst:.2e} over {len(runs[1])} logged steps (tolerance {tolerance:g}): {'ok' if worst <= tolerance else 'MISMATCH'}")
PY
}
SIZE=(accelerator.fsdp.min_num_params=16000000)
PRESET=diffusion run diffusion_eager        $PY scripts/train.py
PRESET=diffusion run diffusion_compile_ac   $PY scripts/train.py accelerator.compile=true accelerator.activation_checkpointing=true
same_losses diffusion_compile_ac diffusion_eager 1e-2  # fused kernels and TF32 convolutions round differently
PRESET=diffusion run diffusion_fsdp_eager   "${TR[@]}" parallelism.dp_shard=-1 "${SIZE[@]}"
PRESET=diffusion run diffusion_fsdp_compile_ac "${TR[@]}" parallelism.dp_shard=-1 "${SIZE[@]}" accelerator.compile=true accelerator.activation_checkpointing=true
same_losses diffusion_fsdp_compile_ac diffusion_fsdp_eager 1e-2
# Without dropout: compiled units draw their dropout masks from inductor's own RNG, not eager's.
run act_fsdp_bf16_eager      "${TR[@]}" parallelism.dp_shard=-1 accelerator.mixed_precision=bf16 policy.dropout=0
run act_fsdp_bf16_compile_ac "${TR[@]}" parallelism.dp_shard=-1 accelerator.mixed_precision=bf16 policy.dropout=0 \
    accelerator.compile=true accelerator.activation_checkpointing=true
same_losses act_fsdp_bf16_compile_ac act_fsdp_bf16_eager 5e-2  # bf16: rounding differences are larger
run act_resnet18_ema_val "${TR[@]}" parallelism.dp_shard=-1 policy.vision_backbone=resnet18 ema.enable=true \
    dataset.val_episodes=1 eval.freq=10 eval.n_episodes=0
VLA_PI0=(policy=pi0 policy.dtype=bfloat16 accelerator=bf16 "policy.tokenizer_name=lerobot_mg/data/vla_tiny/paligemma"
         "dataset.root=$DATA" steps=10 batch_size=4 log_freq=5 logging.progress_bar=false
         checkpoint.save_checkpoint=false eval.n_episodes=0)
vla_check() {  # name, preset array name: the plan, then the run; the ledger's peak beside the plan's total
  local -n overrides=$2
  echo "== $1 at full size: plan for one GPU (FSDP2 on a 1-rank mesh)"
  "${TR[@]}" "${overrides[@]}" parallelism.dp_shard=-1 plan=true "output_dir=$OUT/$1_plan" 2>&1 \
      | sed -n '/memory plan:/,$p' | grep -vE "^  rank [1-9]" || true
  PRESET=$2 run "$1_fsdp1" "${TR[@]}" parallelism.dp_shard=-1
  grep -ohE '"gpu_peak_memory_gb": [0-9.]+' "$OUT/$1_fsdp1/ledger.jsonl" 2>/dev/null | tail -n 1 \
      | sed 's/^/   measured peak (GB, 1e9 bytes): /' || true
}
vla_check pi0_bf16 VLA_PI0
covered "full-size pi0 in bf16: 18 joint-layer FSDP2 units on the 1-rank mesh, trained 10 steps" \
    bash -c "grep -q 'joint units: 18' '$OUT/pi0_bf16_fsdp1.log' && test -f '$OUT/pi0_bf16_fsdp1/rank_bytes.json'"
sync_check "one GPU" $PY "$SYNC_PROBE"
sync_check "FSDP2 on NCCL" $PY -m torch.distributed.run --nproc-per-node=1 --master-port=29556 "$SYNC_PROBE" \
    parallelism.dp_shard=-1
echo
echo "== distributed paths covered on this GPU"
printf '%s\n' "${COVERED[@]}"
cat <<'TXT'
== needs 2 or more GPUs (not covered here; CI runs these layouts on gloo under the same backend rule)
  - NCCL traffic between ranks: DDP's gradient all-reduce across GPUs, FSDP2's all-gather and reduce-scatter of
    real shards (on one rank a collective moves no data between devices), HSDP's replicate and shard groups
  - DCP checkpoints resharded between world sizes, and placement of shard groups within nodes
  - a rank that dies or hangs while others wait in an NCCL collective (accelerator.process_group_timeout_s)
TXT
echo "gpu_check done"
