"""No host sync per step: inside the training loop, no tensor is read on the host (``item``, ``tolist``,
``float()``, ``int()``, ``bool()``) except on log and checkpoint steps, where the metrics are reduced and read.
The runs keep the EMA of their weights (``ema.enable=true``): its update after every optimizer update reads nothing.

On a GPU each such read waits for the device's queue to drain, which leaves a small policy's GPU idle between
steps. The real trainer runs in a child process with those methods counting their calls during each loop step
(from the start of the step to the start of the next batch's wait; the DataLoader's host-side tensors, such as the
sampler's indices, are not the device's, nor are the step counts torch's optimizers keep on the host). ``scripts/gpu_check.sh`` runs the same check on a GPU under
``torch.cuda.set_sync_debug_mode``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.launch_utils import TINY_RUN, run_train

PROBE = '''
import json, os, sys
from pathlib import Path

import torch

import lerobot_mg.train as train_module
from lerobot_mg.checkpoint.manager import CheckpointManager
from lerobot_mg.scripts_entry import train

state = {"active": False, "count": 0, "step": 0, "what": []}
counts, what = {}, {}


def counting(name):
    original = getattr(torch.Tensor, name)

    def wrapper(self, *args, **kwargs):
        caller = sys._getframe(1).f_code.co_filename
        # torch's optimizers keep their step counts on the host (unless capturable or fused): reading them is free.
        if state["active"] and "/torch/optim/" not in caller:
            state["count"] += 1
            state["what"].append(f"{name} {caller}:{sys._getframe(1).f_lineno}")
        return original(self, *args, **kwargs)

    setattr(torch.Tensor, name, wrapper)


for name in ("item", "tolist", "__float__", "__int__", "__bool__", "__index__"):
    counting(name)


def end_step():
    if state["step"]:
        counts[state["step"]] = state["count"]
        what[state["step"]] = sorted(set(state["what"]))
    state.update(active=False, count=0, what=[])


_batches = train_module.endless_batches


def counting_batches(*args, **kwargs):
    inner = _batches(*args, **kwargs)
    while True:
        end_step()
        batch = next(inner)
        state["step"] += 1
        state["active"] = True
        yield batch


_close = CheckpointManager.close


def close(self):
    end_step()
    out = Path(os.environ["SYNC_COUNTS"]) / f"rank{os.environ.get('RANK', '0')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"counts": counts, "what": what}))
    _close(self)


train_module.endless_batches = counting_batches
CheckpointManager.close = close
train()
'''

STEPS, LOG_FREQ, SAVE_FREQ = 12, 5, 8


@pytest.mark.parametrize(("nproc", "layout"), [(1, []), (2, ["parallelism.dp_shard=2"])], ids=["single", "fsdp2"])
def test_no_host_reads_on_steps_that_neither_log_nor_save(nproc: int, layout: list[str], tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    counts_dir = tmp_path / "counts"
    run_train([*TINY_RUN, f"steps={STEPS}", f"log_freq={LOG_FREQ}", f"checkpoint.save_freq={SAVE_FREQ}",
               "optimizer.grad_clip_norm=10", "ema.enable=true", f"output_dir={tmp_path / 'run'}", *layout],
              nproc=nproc, timeout=240, env={"SYNC_COUNTS": str(counts_dir)}, script=probe)
    for rank in range(nproc):
        recorded = json.loads((counts_dir / f"rank{rank}.json").read_text())
        counts = {int(step): n for step, n in recorded["counts"].items()}
        assert sorted(counts) == list(range(1, STEPS + 1))
        quiet = {step for step in counts if step % LOG_FREQ and step % SAVE_FREQ and step != STEPS}
        assert {step: counts[step] for step in quiet} == dict.fromkeys(quiet, 0), recorded["what"]
        assert all(counts[step] > 0 for step in (LOG_FREQ, 2 * LOG_FREQ)), counts  # the counting does count
