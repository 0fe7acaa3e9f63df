"""Multi-node without SLURM: two torchrun launchers on this host (``--nnodes=2 --node-rank=0/1``, static rendezvous
at ``--rdzv-endpoint``) run HSDP-2x2 as two nodes of two ranks. The run records its placement: each shard group lies
inside one node (ranks 0-1, 2-3) and replication crosses nodes, as the guide's "shard within each node, replicate
across nodes" requires.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.launch_utils import PYTHON, REPO, TINY_RUN, TRAIN_SCRIPT, clean_env, free_port, kill_tree

pytestmark = pytest.mark.dist


def test_two_torchrun_nodes_shard_within_and_replicate_across_nodes(tmp_path: Path) -> None:
    output_dir, endpoint = tmp_path / "run", f"127.0.0.1:{free_port()}"
    logs = [tmp_path / f"node{node}.log" for node in (0, 1)]
    launchers = []
    for node, log_path in enumerate(logs):
        cmd = [PYTHON, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}", "--nproc-per-node=2",
               f"--rdzv-endpoint={endpoint}", str(TRAIN_SCRIPT), *TINY_RUN, "steps=2",
               "parallelism.dp_replicate=2", "parallelism.dp_shard=2", f"output_dir={output_dir}"]
        with open(log_path, "w") as log:
            launchers.append(subprocess.Popen(cmd, env=clean_env(), cwd=REPO, stdout=log, stderr=subprocess.STDOUT))
    try:
        codes = [launcher.wait(timeout=240) for launcher in launchers]
    except subprocess.TimeoutExpired:
        raise AssertionError(f"watchdog: the two nodes ran over 240 s\n{logs[0].read_text()[-4000:]}") from None
    finally:
        for launcher in launchers:
            if launcher.poll() is None:
                kill_tree(launcher)
    stdout = logs[0].read_text()
    assert codes == [0, 0], stdout[-4000:] + logs[1].read_text()[-4000:]
    assert "topology: HSDP: 2 replicas x 2 shards" in stdout
    placement = json.loads((output_dir / "placement.json").read_text())
    assert placement["node_of_rank"] == [0, 0, 1, 1]
    assert placement["shard_groups"] == [[0, 1], [2, 3]] and placement["replicate_groups"] == [[0, 2], [1, 3]]
    assert placement["shard_groups_within_nodes"] and placement["replication_across_nodes"]
    assert "shard groups [[0, 1], [2, 3]] each within one node; replicate groups [[0, 2], [1, 3]] across nodes" in (
        output_dir / "train.log").read_text()
    assert (output_dir / "checkpoints/last/pretrained_model/model.safetensors").is_file()
