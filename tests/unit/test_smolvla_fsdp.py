"""SmolVLA's declared units under FSDP2, on 2 real processes (gloo): each joint layer (VLM layer i with expert layer
i) sharded as one grouped unit with torch's ``fully_shard([vlm_i, expert_i])``, the vision encoder's layers as units,
the rest in the root. The training loss and every gradient (with and without activation checkpointing of each joint
layer) and the denoised chunk equal the unsharded policy's to the bit, and after training and inference every joint
layer and vision layer is sharded again (only the root's own parameters stay gathered, as FSDP2 keeps the root's).

Run as a script, this file is one rank (the test starts two)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from tests.launch_utils import PYTHON, REPO, clean_env, spawn_ranks

FIXTURES = REPO / "tests" / "fixtures" / "lerobot_0_6_1"


def test_joint_layers_as_grouped_fsdp2_units_train_and_infer_as_unsharded(tmp_path: Path) -> None:
    proc = spawn_ranks([PYTHON, str(Path(__file__).resolve()), str(tmp_path)], 2,
                       clean_env({"PYTHONPATH": str(REPO)}), REPO, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:]
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for run in (result["recomputed"], result["stored"]):
            assert run["units"] == 4 + 1  # four joint layers, one vision encoder layer
            assert run["loss_diff"] == 0.0 and run["grad_diff"] == 0.0, result
            assert run["grads_compared"] == 47  # every trainable parameter: the expert and the projections
        assert result["chunk_diff"] == 0.0, result
        assert result["gathered_after"] and all(
            not name.startswith(("model.vlm_with_expert.vlm.model.text_model.layers.",
                                 "model.vlm_with_expert.lm_expert.layers.",
                                 "model.vlm_with_expert.vlm.model.vision_model.encoder.layers."))
            for name in result["gathered_after"]
        ), result["gathered_after"]


def _rank_main(out_dir: Path) -> None:
    import torch.distributed as dist
    from safetensors.torch import load_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method
    from torch.distributed.tensor import DTensor

    from lerobot_mg.policies.base import checkpoint_activations
    from lerobot_mg.policies.smolvla import SmolVLAPolicy

    torch.set_num_threads(1)
    os.chdir(FIXTURES)  # the fixture's vlm_model_name is relative to it
    dist.init_process_group("gloo")
    ref = load_file("smolvla_tiny/reference.safetensors")
    batch = {key[len("pre."):]: value for key, value in ref.items() if key.startswith("pre.")}
    batch["action_is_pad"] = ref["input.action_is_pad"]
    for camera in ("observation.images.top", "observation.images.wrist"):
        batch[camera] = ref[f"input.{camera}.uint8"].float() / 255
    plain = SmolVLAPolicy.from_pretrained(Path("smolvla_tiny/pretrained_model"))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    results = {}
    plain.train()
    plain_loss, _ = plain(batch, noise=ref["input.noise"], time=ref["input.time"])
    plain_loss.backward()
    for recompute in (True, False):  # with activation checkpointing of each joint layer, then without
        sharded = SmolVLAPolicy.from_pretrained(Path("smolvla_tiny/pretrained_model"))
        units = 0
        for group in sharded.fsdp_unit_groups():
            if recompute:
                checkpoint_activations(group[0])  # as accelerator.activation_checkpointing does (_checkpoint_modules)
            fully_shard(list(group), mesh=mesh)
            units += 1
        for module in sharded.modules():
            if type(module).__name__ in sharded._fsdp_wrap_modules:
                fully_shard(module, mesh=mesh)
                units += 1
        fully_shard(sharded, mesh=mesh)
        sharded.train()
        loss, _ = sharded(batch, noise=ref["input.noise"], time=ref["input.time"])
        loss.backward()
        grad_diffs = [
            (mine.grad.full_tensor() - theirs.grad).abs().max().item()
            for mine, theirs in zip(sharded.parameters(), plain.parameters(), strict=True) if theirs.grad is not None
        ]
        key = "recomputed" if recompute else "stored"
        results[key] = {"units": units, "loss_diff": (loss.detach() - plain_loss.detach()).abs().item(),
                        "grad_diff": max(grad_diffs), "grads_compared": len(grad_diffs)}
    register_fsdp_forward_method(sharded, "predict_action_chunk")  # inference does not go through forward
    chunks = []
    for policy in (sharded, plain):
        policy.eval()
        chunks.append(policy.predict_action_chunk(batch, noise=ref["input.sample_noise"]))
    results["chunk_diff"] = (chunks[0] - chunks[1]).abs().max().item()
    results["gathered_after"] = [name for name, p in sharded.named_parameters() if not isinstance(p, DTensor)]
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    _rank_main(Path(sys.argv[1]))
