"""Failure reporting: a rank that fails names itself, its traceback reaches the launcher's failure summary,
and a rank that only lost a peer says so and leaves the root cause to the rank that failed first.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
import traceback
from typing import NoReturn

from lerobot_mg.distributed.accelerator import launch_world

# How gloo and NCCL word a collective that failed because a peer process is gone (exited, killed, unreachable).
_PEER_LOSS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
              "remote process exited", "NCCL communicator was aborted")
# A rank that lost a peer waits this long for the launcher to stop it (torchrun checks its workers every 0.1 s), so
# the launcher records the rank that failed first as the root cause, not this consequence.
PEER_LOSS_GRACE_S = 5.0


def lost_a_peer(error: BaseException) -> bool:
    """True for a collective that failed because another rank is gone: a consequence, not a cause."""
    return any(marker in str(error) for marker in _PEER_LOSS)


def report_failure(error: BaseException) -> NoReturn:
    """Print the full traceback of a failure that is not a user error, naming the rank that raised it, record it in
    the launcher's error file, and exit with status 1.

    torchrun and ``accelerate launch`` (torch's elastic agent) give every worker an error file
    (``TORCHELASTIC_ERROR_FILE``); what is recorded there becomes the "Root Cause" of the launcher's failure summary,
    with the rank and its traceback. torch's ``@record`` decorator does the same, but only for an exception that
    propagates through it: Hydra's task wrapper catches the exception first and turns it into ``sys.exit(1)``, which
    ``@record`` lets pass unrecorded. So the entry point calls this inside the task function.

    A distributed rank leaves with ``os._exit``: interpreter shutdown runs the destructors of the communication
    objects (DDP's reducer, the gloo/NCCL process group), which can block on peers that are still waiting in a
    collective, and a failed rank that does not exit keeps the whole job waiting for the collective timeout. Its
    exit is what makes the launcher stop the other ranks.
    """
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    world_size, rank, local_rank = launch_world()
    consequence = lost_a_peer(error)
    what = ("lost a peer in a collective (another rank failed or died first; the launcher's root cause names it)"
            if consequence else "failed")
    trace = "".join(traceback.format_exception(error))
    print(f"lerobot-mg-train: rank {rank} of {world_size} (local rank {local_rank} on {socket.gethostname()}, "
          f"pid {os.getpid()}) {what}:\n{trace}", file=sys.stderr, flush=True)
    if consequence:
        time.sleep(PEER_LOSS_GRACE_S)  # the launcher stops this rank (SIGTERM) before this returns
    elif os.environ.get("TORCHELASTIC_ERROR_FILE"):  # set by torch's elastic agent only
        get_error_handler().record_exception(error)
    if world_size == 1:
        raise SystemExit(1)
    logging.shutdown()  # flush the run's log file: os._exit skips that
    sys.stdout.flush()
    os._exit(1)
