"""dataset=mixture's reader and sampler (lerobot_mg.data.mixture) on two robots: an ALOHA-shaped dataset (14-dim
state and action, a 24x32 top camera as video, 50 fps) written by our writer and the shipped PushT slice (2-dim state
and action, a 96x96 PNG camera, 10 fps), its camera renamed."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from lerobot_mg.config.act import ACTConfig
from lerobot_mg.config.choices import DatasetName
from lerobot_mg.config.pi0 import PI0Config
from lerobot_mg.config.schema import DatasetConfig, SourceConfig
from lerobot_mg.data.lerobot_dataset import LeRobotDataset
from lerobot_mg.data.meta import DatasetMeta
from lerobot_mg.data.mixture import MixtureDataset, MixtureSampler, plan_mixture
from lerobot_mg.errors import ConfigError
from lerobot_mg.policies.base import ACTION_DIM_PAD_KEY, SOURCE_INDEX_KEY, delta_timestamps, empty_camera_key
from tests.launch_utils import PUSHT_SLICE
from tests.vla_preset_aids import shared_vla_dataset

TOP = "observation.images.top"
KEYS = ["observation.state", TOP, "action"]
CHUNK = 4


@pytest.fixture(scope="module")
def aloha(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shared_vla_dataset(tmp_path_factory)


def _sources(aloha: Path, pusht_camera: str = TOP, weights: tuple = (0.7, 0.3)) -> list[SourceConfig]:
    return [SourceConfig(root=str(aloha), weight=weights[0]),
            SourceConfig(root=str(PUSHT_SLICE), weight=weights[1], rename_map={"observation.image": pusht_camera})]


def _policy(keys: list[str] | None = None) -> PI0Config:
    return PI0Config(observation_keys=keys or KEYS[:2], chunk_size=CHUNK, n_action_steps=CHUNK)


def _mixture(sources: list[SourceConfig], policy=None, keys=KEYS) -> MixtureDataset:
    policy = policy or _policy()
    plan = plan_mixture(DatasetConfig(name=DatasetName.mixture, sources=sources), [DatasetMeta.read(s.root) for s in sources],
                        policy)
    return MixtureDataset(plan, functools.partial(delta_timestamps, policy, plan.features), keys)


def test_two_robots_are_padded_to_the_longest_and_marked(aloha: Path) -> None:
    mixture = _mixture(_sources(aloha))
    assert mixture.plan.padded == {"observation.state", "action"} and not mixture.plan.empty_cameras
    assert mixture.features["action"]["shape"] == [14] and mixture.features[TOP]["shape"] == [24, 32, 3]
    aloha_len = len(mixture.datasets[0])
    pusht = LeRobotDataset(PUSHT_SLICE, {"action": [i / 10 for i in range(CHUNK)]}, keys=["observation.state", "action",
                                                                                     "observation.image"],
                           uint8_visuals=True)
    item = mixture.collate([mixture[aloha_len + 5]])
    item = {key: value[0] for key, value in item.items()}
    own = pusht[5]
    assert int(item["index"]) == aloha_len + 5 and int(item[SOURCE_INDEX_KEY]) == 1
    # Its own 2 dims, then zeros; the action chunk read at PushT's 10 fps (frames 5..8 of its episode).
    assert torch.equal(item["observation.state"][:2], own["observation.state"])
    assert torch.equal(item["observation.state"][2:], torch.zeros(12))
    assert item["action"].shape == (CHUNK, 14) and torch.equal(item["action"][:, :2], own["action"])
    assert torch.equal(item[ACTION_DIM_PAD_KEY], torch.arange(14) >= 2)
    # The 96x96 camera resized to the mixture's 24x32, under the policy's name.
    assert item[TOP].shape == (3, 24, 32) and item[TOP].dtype == torch.uint8
    first = {key: value[0] for key, value in mixture.collate([mixture[0]]).items()}
    assert int(first[SOURCE_INDEX_KEY]) == 0 and not first[ACTION_DIM_PAD_KEY].any()
    assert mixture[aloha_len + 5]["action"].shape == (CHUNK, 2)  # an item keeps its own size; collate pads a batch
    assert first["task"] != item["task"]
    sources, episodes = mixture.locate(np.array([0, aloha_len - 1, aloha_len, len(mixture) - 1]))
    assert sources.tolist() == [0, 0, 1, 1]
    assert episodes.tolist() == [0, 1, 0, DatasetMeta.read(PUSHT_SLICE).episodes.num_rows - 1]


def test_a_camera_a_source_lacks_is_empty_and_marked(aloha: Path) -> None:
    side = "observation.images.side"
    mixture = _mixture(_sources(aloha, pusht_camera=side), policy=_policy([KEYS[0], TOP, side]),
                       keys=[*KEYS, side])
    assert mixture.plan.empty_cameras == {TOP, side}
    aloha_item, pusht_item = mixture[0], mixture[len(mixture.datasets[0])]
    assert not aloha_item[empty_camera_key(TOP)] and aloha_item[empty_camera_key(side)]
    assert pusht_item[empty_camera_key(TOP)] and not pusht_item[empty_camera_key(side)]
    assert torch.equal(pusht_item[TOP], torch.zeros(3, 24, 32, dtype=torch.uint8))
    assert pusht_item[side].shape == (3, 96, 96) and pusht_item[side].any()
    batch = mixture.collate([aloha_item, pusht_item])  # every key in both: one batch
    assert batch[empty_camera_key(TOP)].tolist() == [False, True]


def test_the_weighted_order_is_a_function_of_seed_and_epoch(aloha: Path) -> None:
    mixture = _mixture(_sources(aloha))
    first, again = (MixtureSampler(mixture, 4, seed=3) for _ in range(2))
    assert torch.equal(first.permutation(0), again.permutation(0))
    assert not torch.equal(first.permutation(0), first.permutation(1))
    assert not torch.equal(first.permutation(0), MixtureSampler(mixture, 4, seed=4).permutation(0))
    order = first.permutation(0)
    sources = mixture.locate(order.numpy())[0]
    share = np.bincount(sources, minlength=2) / len(sources)
    assert abs(share[0] - 0.7) < 0.06, share  # ALOHA: 24 frames drawn ~311 times out of 444: 13 laps
    aloha_draws = order[torch.from_numpy(sources == 0)]
    assert sorted(aloha_draws[:24].tolist()) == list(range(24))  # a lap draws each frame once before any repeats
    # The next lap is the same frames as other presentations: index k * N + frame, so each has its own sample seed.
    assert sorted(aloha_draws[24:48].tolist()) == [len(mixture) + frame for frame in range(24)]
    item = mixture[int(aloha_draws[30])]
    assert int(item["index"]) == int(aloha_draws[30]) and int(item[SOURCE_INDEX_KEY]) == 0
    assert len(set(order.tolist())) == len(order)  # every presentation of the epoch is another index


def test_a_batch_indexes_the_mixture_whatever_the_episodes_a_source_reads(aloha: Path) -> None:
    sources = [SourceConfig(root=str(PUSHT_SLICE), episodes=[2]),
               SourceConfig(root=str(PUSHT_SLICE), episodes=[0, 1], rename_map={})]
    mixture = _mixture(sources, policy=ACTConfig(observation_keys=["observation.state"], chunk_size=CHUNK,
                                                 n_action_steps=CHUNK), keys=["observation.state", "action"])
    window = MixtureSampler(mixture, 8, seed=0).global_window()
    batch = mixture.collate([mixture[int(index)] for index in window])
    assert batch["index"].tolist() == window.tolist()
    own = [mixture.datasets[s][int(i) % len(mixture) - int(mixture.offsets[s])]["index"]
           for s, i in zip(batch[SOURCE_INDEX_KEY].tolist(), window)]
    assert [int(o) for o in own] != window.tolist()  # the slice's own frame indices are not the mixture's


def test_ranks_split_each_global_window_and_a_resume_continues_it(aloha: Path) -> None:
    mixture = _mixture(_sources(aloha))
    ranks = [MixtureSampler(mixture, 3, seed=0, rank=r, world_size=2) for r in range(2)]
    for sampler in ranks:
        sampler.advance(5)
    window = ranks[0].global_window()
    batches = [next(iter(sampler)) for sampler in ranks]
    assert batches[0] + batches[1] == window.tolist()  # rank 0 the first 3 positions, rank 1 the next 3

    resumed = MixtureSampler(mixture, 3, seed=0, rank=1, world_size=2)
    resumed.load_state_dict(ranks[1].state_dict())
    assert [next(iter(resumed))] == [batches[1]]

    other = _mixture(_sources(aloha, weights=(0.5, 0.5)))
    with pytest.raises(ConfigError, match=r"another mixture"):
        MixtureSampler(other, 3, seed=0, rank=1, world_size=2).load_state_dict(ranks[1].state_dict())


def test_a_large_order_is_shared_through_the_cache(aloha: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("lerobot_mg.data.sampler.MAP_PERMUTATION_FROM", 1)
    mixture = _mixture(_sources(aloha))
    mapped = MixtureSampler(mixture, 4, seed=1)
    assert mapped.cache_dir is not None
    monkeypatch.setattr("lerobot_mg.data.sampler.MAP_PERMUTATION_FROM", 1 << 40)
    in_memory = MixtureSampler(mixture, 4, seed=1)
    assert in_memory.cache_dir is None
    assert torch.equal(mapped.permutation(0), in_memory.permutation(0))


def _refusal(aloha: Path, sources: list[SourceConfig], policy=None) -> str:
    with pytest.raises(ConfigError) as caught:
        plan_mixture(DatasetConfig(name=DatasetName.mixture, sources=sources),
                     [DatasetMeta.read(s.root) for s in sources], policy or _policy())
    return str(caught.value)


def test_bad_mixtures_are_refused_naming_the_source(aloha: Path, tmp_path: Path) -> None:
    assert "dataset.sources.1.weight=-0.5: must be a finite number >= 0" in _refusal(aloha, _sources(aloha, weights=(1, -0.5)))
    assert "weights are all zero" in _refusal(aloha, _sources(aloha, weights=(0, 0)))
    assert "some sources a weight and others none" in _refusal(aloha, _sources(aloha, weights=(1, None)))
    twice = [SourceConfig(root=str(aloha)), SourceConfig(root=str(aloha))]
    assert "dataset.sources.1=" in _refusal(aloha, twice) and "same dataset" in _refusal(aloha, twice)
    collide = _sources(aloha)
    collide[1].rename_map = {"observation.image": "observation.state"}
    assert "maps two features" in _refusal(aloha, collide)
    unknown = _sources(aloha)
    unknown[1].rename_map = {"observation.images.wrist": TOP}
    assert "renames ['observation.images.wrist'], which" in _refusal(aloha, unknown)
    newer = tmp_path / "newer"
    shutil.copytree(PUSHT_SLICE, newer)
    info = json.loads((newer / "meta/info.json").read_text())
    (newer / "meta/info.json").write_text(json.dumps({**info, "codebase_version": "v3.1"}))
    versions = [SourceConfig(root=str(aloha)), SourceConfig(root=str(newer), rename_map={"observation.image": TOP})]
    assert "is a LeRobot v3.1 dataset, dataset.sources.0 a v3.0 one" in _refusal(aloha, versions)


def test_a_policy_that_cannot_pad_is_refused_naming_the_source_and_key(aloha: Path) -> None:
    act = ACTConfig(observation_keys=KEYS[:2], chunk_size=CHUNK, n_action_steps=CHUNK)
    message = _refusal(aloha, _sources(aloha), act)
    assert message.startswith("dataset.sources.1='pusht_image_slice': holds observation.state of shape [2]"), message
    assert "policy.type=act cannot pad it" in message
    side = _sources(aloha, pusht_camera="observation.images.side")
    message = _refusal(aloha, side, act)
    assert "dataset.sources.1='pusht_image_slice': has no observation.images.top, which policy.type=act reads" in message


class _Map:
    """A source's normalisation map as lerobot_mg.processors.mixture.SourceAffine holds it."""

    def __init__(self, seed: int, length: int = 14) -> None:
        rng = np.random.default_rng(seed)
        self.offset, self.scale, self.shift = ({key: rng.normal(size=length).astype(np.float32)
                                                for key in ("observation.state", "action")} for _ in range(3))


def test_a_batch_maps_each_sample_with_its_own_sources_map(aloha: Path) -> None:
    mixture = _mixture(_sources(aloha))
    raw = mixture.collate([mixture[0], mixture[len(mixture.datasets[0]) + 3]])
    maps = [_Map(0), _Map(1)]
    mixture.set_normalisation(maps)
    mapped = mixture.collate([mixture[0], mixture[len(mixture.datasets[0]) + 3]])
    for row, source in enumerate((0, 1)):
        for key in ("observation.state", "action"):
            m = maps[source]
            expected = (raw[key][row] - torch.from_numpy(m.offset[key])) * torch.from_numpy(m.scale[key]) + \
                torch.from_numpy(m.shift[key])
            assert torch.equal(mapped[key][row], expected), (key, row)


def test_what_would_fail_mid_run_is_refused_at_start_up(aloha: Path, tmp_path: Path) -> None:
    # A copy of the slice elsewhere is the same data: its episodes would be drawn at both weights.
    copy = tmp_path / "copy"
    shutil.copytree(PUSHT_SLICE, copy)
    same = [SourceConfig(root=str(PUSHT_SLICE), episodes=[0, 1]), SourceConfig(root=str(copy), episodes=[1, 2])]
    assert "is the same dataset as dataset.sources.0 and shares its episodes [1]" in _refusal(aloha, same)
    # A vector the VLA reads that one source lacks has no stand-in (a camera has: an empty one).
    no_state = _sources(aloha)
    no_state[1].rename_map = {"observation.image": TOP, "observation.state": "observation.environment_state"}
    assert "has no observation.state, which policy.type=pi0 reads" in _refusal(aloha, no_state)
    # Vectors other than the state and action are not padded.
    reward = [SourceConfig(root=str(PUSHT_SLICE), episodes=[0, 1]),
              SourceConfig(root=str(PUSHT_SLICE), episodes=[2], rename_map={"next.reward": "observation.effort",
                                                                             "observation.state": "next.reward"})]
    message = _refusal(aloha, reward)
    assert "holds next.reward of shape [2], another source [1]; only the state and action vectors" in message, message


def test_source_names_are_unique(aloha: Path) -> None:
    sources = [SourceConfig(root=str(PUSHT_SLICE), episodes=[0]), SourceConfig(root=str(PUSHT_SLICE), episodes=[1]),
               SourceConfig(root=str(PUSHT_SLICE), episodes=[2])]
    policy = ACTConfig(observation_keys=["observation.state"], chunk_size=CHUNK, n_action_steps=CHUNK)
    plan = plan_mixture(DatasetConfig(name=DatasetName.mixture, sources=sources),
                        [DatasetMeta.read(s.root) for s in sources], policy)
    assert [s.name for s in plan.sources] == ["pusht_image_slice", "pusht_image_slice_1", "pusht_image_slice_2"]
