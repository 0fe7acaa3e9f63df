"""Every rank draws its own noise after a resume onto more ranks.

A checkpoint holds one RNG stream per saved rank. On the same topology each rank restores its own (bit-exact
resumes: tests/dist/test_resume.py compares rng_state.safetensors and the weights). After 1 -> 2 ranks, both ranks
would restore the one saved stream and draw identical dropout for the rest of the run; instead each rank seeds a
stream of its own from the saved one and its rank.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lerobot_mg.checkpoint.state import seed_rank_streams
from lerobot_mg.checkpoint.state import capture_rng_state
from tests.dist.test_checkpoints import copy_run, reference_run
from tests.dist.test_resume import resume_args
from tests.launch_utils import run_train

# The real trainer, with CheckpointManager.load wrapped to draw one dropout mask right after the load.
PROBE = '''
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from lerobot_mg.checkpoint.manager import CheckpointManager
from lerobot_mg.scripts_entry import train

_load = CheckpointManager.load


def load_and_draw(self, *args):
    _load(self, *args)
    mask = torch.nn.functional.dropout(torch.ones(4096), p=0.5) > 0
    out = Path(os.environ["MASK_DIR"])
    out.mkdir(parents=True, exist_ok=True)
    save_file({"mask": mask.contiguous()}, str(out / f"rank{self.dims.rank}.safetensors"))


CheckpointManager.load = load_and_draw
train()
'''


def test_seeded_streams_are_reproducible_and_differ_by_rank() -> None:
    torch.manual_seed(3)
    saved = capture_rng_state()
    draws = {}
    for rank in (0, 1, 0):
        seed_rank_streams(saved, rank)
        draws.setdefault(rank, []).append(torch.rand(8))
    torch.testing.assert_close(draws[0][0], draws[0][1], rtol=0, atol=0)  # the same saved stream and rank
    assert not torch.equal(draws[0][0], draws[1][0])


@pytest.mark.dist
def test_dropout_masks_differ_across_ranks_after_a_1_to_2_resume(tmp_path: Path,
                                                                 tmp_path_factory: pytest.TempPathFactory) -> None:
    """The one-process reference run (dropout and VAE sampling on), resumed at step 4 on DDP-2."""
    run_dir = copy_run(reference_run(tmp_path_factory, "single"), tmp_path / "run")
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    masks = tmp_path / "masks"
    run_train([*resume_args(run_dir, 4), "batch_size=8", "steps=6"], nproc=2, timeout=240,
              env={"MASK_DIR": str(masks)}, script=probe)
    rank0, rank1 = (load_file(str(masks / f"rank{rank}.safetensors"))["mask"] for rank in (0, 1))
    assert rank0.float().mean().item() == pytest.approx(0.5, abs=0.05)  # a real dropout draw
    assert not torch.equal(rank0, rank1)
