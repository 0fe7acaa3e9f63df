#!/usr/bin/env bash
# GPU check (not part of CI): what only a GPU can show. About 10 minutes on one GPU.
#
#   bash scripts/gpu_check.sh            # needs a CUDA torch in .venv or on the PATH's python
#
# 1. NCCL path: a 1-GPU run goes through the same Accelerate factory (single process, then torchrun with 1 rank
#    and parallelism.dp_shard=-1 so FSDP2 is built on NCCL, not the CPU rehearsal).
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
  "$@" "${preset[@]}" "output_dir=$OUT/$name" 2>&1 | grep -E "topology|batch:|precision|activation checkpointing:|torch.compile:|wrap units|Checkpoint |Error|error" || true
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
run fp32_single      $PY scripts/train.py
run bf16_single      $PY scripts/train.py accelerator.mixed_precision=bf16
run fp16_single      $PY scripts/train.py accelerator.mixed_precision=fp16
run fsdp_bf16_nccl   "${TR[@]}" parallelism.dp_shard=-1 accelerator.mixed_precision=bf16
run fsdp_fp16_nccl   "${TR[@]}" parallelism.dp_shard=-1 accelerator.mixed_precision=fp16
run fsdp_offload     "${TR[@]}" parallelism.dp_shard=-1 accelerator.mixed_precision=bf16 accelerator.fsdp.cpu_offload=true
run fsdp_dcp_resume0 "${TR[@]}" parallelism.dp_shard=-1 checkpoint.format=dcp steps=20
echo "== resume from DCP on NCCL"
"${TR[@]}" resume=true "config_path=$OUT/fsdp_dcp_resume0/checkpoints/last/pretrained_model/train_config.json" steps=40 2>&1 | grep -E "resumed|Error" || true

run fsdp_async_dcp  "${TR[@]}" parallelism.dp_shard=-1 checkpoint.format=dcp checkpoint.async_save=true \
    checkpoint.save_freq=10 steps=20
echo "== resume from an asynchronously written DCP checkpoint on NCCL"
"${TR[@]}" resume=true "config_path=$OUT/fsdp_async_dcp/checkpoints/last/pretrained_model/train_config.json" steps=40 \
    checkpoint.async_save=true 2>&1 | grep -E "resumed|Checkpoint |Error" || true
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
sync_check "one GPU" $PY "$SYNC_PROBE"
sync_check "FSDP2 on NCCL" $PY -m torch.distributed.run --nproc-per-node=1 --master-port=29556 "$SYNC_PROBE" \
    parallelism.dp_shard=-1
echo "gpu_check done"
