"""scripts/train.py with a check on the way out, for tests/dist/test_teardown.py.

Each call of ``torch.distributed.destroy_process_group`` prints how many DDP wrappers are still alive. A run must
free its DDP wrapper (and so its C++ reducer) before the process groups go: a reducer that holds the last reference
to a gloo group destroys it under the GIL and can deadlock the exit (see lerobot_mg/launch/run_state.py).
"""

import gc

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lerobot_mg.scripts_entry import train

_destroy_process_group = dist.destroy_process_group


def _counting_destroy(group=None) -> None:
    alive = sum(isinstance(obj, DistributedDataParallel) for obj in gc.get_objects())
    print(f"teardown probe: rank {dist.get_rank()} destroys the process groups with {alive} DDP wrapper(s) alive",
          flush=True)
    _destroy_process_group(group)


dist.destroy_process_group = _counting_destroy

if __name__ == "__main__":
    train()
