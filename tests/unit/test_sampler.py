import pytest
import torch

from lerobot_mg.data.sampler import ResumableBatchSampler


def _global_batches(samplers: list[ResumableBatchSampler]) -> list[list[int]]:
    """Concatenates the ranks' batches step by step (rank order), as the global batch."""
    per_rank = [list(sampler) for sampler in samplers]
    return [sum(step_batches, []) for step_batches in zip(*per_rank, strict=True)]


def _ranks(num_samples: int, batch_size: int, world_size: int, seed: int = 0) -> list[ResumableBatchSampler]:
    return [
        ResumableBatchSampler(num_samples, batch_size, seed, rank, world_size) for rank in range(world_size)
    ]


def test_order_depends_only_on_seed_and_epoch() -> None:
    torch.manual_seed(0)
    first = list(ResumableBatchSampler(50, batch_size=5, seed=7))
    torch.manual_seed(123)
    torch.rand(1000)  # global RNG use must not matter
    second = list(ResumableBatchSampler(50, batch_size=5, seed=7))
    assert first == second
    assert first != list(ResumableBatchSampler(50, batch_size=5, seed=8))
    sampler = ResumableBatchSampler(50, batch_size=5, seed=7)
    assert sampler.permutation(0).tolist() != sampler.permutation(1).tolist()
    assert sorted(sampler.permutation(1).tolist()) == list(range(50))
    # (seed, epoch) pairs with the same sum are different streams.
    assert ResumableBatchSampler(50, 5, seed=0).permutation(1).tolist() != sampler.permutation(0).tolist()
    assert (
        ResumableBatchSampler(50, 5, seed=1).permutation(0).tolist()
        != ResumableBatchSampler(50, 5, seed=0).permutation(1).tolist()
    )


def test_no_shuffle_is_in_order() -> None:
    sampler = ResumableBatchSampler(10, batch_size=2, seed=0, rank=1, world_size=2, shuffle=False)
    assert list(sampler) == [[2, 3], [6, 7]]


def test_ranks_partition_each_global_batch() -> None:
    samplers = _ranks(num_samples=40, batch_size=3, world_size=4)
    permutation = samplers[0].permutation(0).tolist()
    global_batches = _global_batches(samplers)
    assert len(global_batches) == samplers[0].num_steps_per_epoch == 3  # 40 // 12, the last 4 dropped
    for step, global_batch in enumerate(global_batches):
        assert global_batch == permutation[step * 12 : (step + 1) * 12]
        assert len(set(global_batch)) == 12


def test_same_global_batch_with_a_different_split() -> None:
    reference = _global_batches(_ranks(num_samples=37, batch_size=8, world_size=1))
    assert _global_batches(_ranks(num_samples=37, batch_size=4, world_size=2)) == reference
    assert _global_batches(_ranks(num_samples=37, batch_size=2, world_size=4)) == reference
    assert len(reference) == 4


def test_iteration_does_not_advance_and_advance_rolls_over() -> None:
    sampler = ResumableBatchSampler(10, batch_size=3, seed=1)
    assert len(sampler) == 3
    epoch_0 = list(sampler)
    assert list(sampler) == epoch_0 and (sampler.epoch, sampler.offset) == (0, 0)
    sampler.advance()
    assert (sampler.epoch, sampler.offset, len(sampler)) == (0, 3, 2)
    assert list(sampler) == epoch_0[1:]
    sampler.advance(2)
    assert (sampler.epoch, sampler.offset, len(sampler)) == (1, 0, 3)
    epoch_1 = list(sampler)
    assert epoch_1 != epoch_0
    assert epoch_1[0] == sampler.permutation(1).tolist()[:3]
    sampler.advance(4)  # across the next boundary: 3 steps of epoch 1, then one of epoch 2
    assert (sampler.epoch, sampler.offset) == (2, 3)
    # An iterator keeps the position it started from, even when the loop advances before drawing.
    iterator = iter(sampler)
    sampler.advance()
    assert next(iterator) == sampler.permutation(2).tolist()[3:6]


def test_state_round_trip_mid_epoch_is_sample_exact() -> None:
    original = ResumableBatchSampler(100, batch_size=4, seed=5, rank=1, world_size=2)
    original.advance(13)  # epoch 1 (12 steps per epoch), step 1
    state = original.state_dict()
    assert state == {"epoch": 1, "offset": 8, "seed": 5, "num_samples": 100}
    resumed = ResumableBatchSampler(100, batch_size=4, seed=5, rank=1, world_size=2)
    assert resumed.load_state_dict(state) == "epoch 1, sample offset 8"
    assert list(resumed) == list(original)
    assert len(resumed) == 11


def test_resume_on_another_world_size_same_global_batch() -> None:
    before = _ranks(num_samples=64, batch_size=4, world_size=2, seed=9)
    uninterrupted = _global_batches(_ranks(num_samples=64, batch_size=4, world_size=2, seed=9))
    for sampler in before:
        sampler.advance(3)
    after = _ranks(num_samples=64, batch_size=2, world_size=4, seed=9)
    assert {sampler.load_state_dict(before[0].state_dict()) for sampler in after} == {"epoch 0, sample offset 24"}
    assert _global_batches(after) == uninterrupted[3:]  # global-batch-exact: the same global batches


def test_resume_with_a_different_global_batch_continues_at_the_offset() -> None:
    before = ResumableBatchSampler(64, batch_size=4, seed=9, world_size=2)
    before.advance(3)  # 24 samples consumed
    after = _ranks(num_samples=64, batch_size=4, world_size=3, seed=9)  # G = 12
    for sampler in after:
        assert sampler.load_state_dict(before.state_dict()) == "epoch 0, sample offset 24"
    permutation = after[0].permutation(0).tolist()
    assert _global_batches(after) == [permutation[24:36], permutation[36:48], permutation[48:60]]
    after[0].advance(3)
    assert (after[0].epoch, after[0].offset) == (1, 0)


def test_resume_near_the_end_of_an_epoch_rolls_over() -> None:
    before = ResumableBatchSampler(20, batch_size=2, seed=0)
    before.advance(8)  # offset 16: 4 samples left, fewer than the new global batch of 6
    after = ResumableBatchSampler(20, batch_size=3, seed=0, world_size=2)
    position = after.load_state_dict(before.state_dict())
    assert (after.epoch, after.offset, len(after)) == (1, 0, 3)
    assert position == ("epoch 0, sample offset 16 (too few samples remained for one global batch: continuing at "
                        "epoch 1, offset 0)")


def test_user_errors() -> None:
    with pytest.raises(ValueError, match=r"fewer than one global batch of batch_size=8 x world size 4 = 32"):
        ResumableBatchSampler(20, batch_size=8, seed=0, world_size=4)
    with pytest.raises(ValueError, match="rank=2 and world_size=2"):
        ResumableBatchSampler(20, batch_size=2, seed=0, rank=2, world_size=2)
    sampler = ResumableBatchSampler(20, batch_size=2, seed=0)
    with pytest.raises(ValueError, match="saved for a dataset of 30 samples"):
        sampler.load_state_dict({**sampler.state_dict(), "num_samples": 30})
    with pytest.raises(ValueError, match=r"seed=\d+: the sampler state was saved with seed=4\. Fix: seed=4"):
        sampler.load_state_dict({**sampler.state_dict(), "seed": 4})
