"""A weighted mixture of LeRobot datasets, read as one dataset (``dataset=mixture``, ``dataset.sources``).

Each source is a LeRobot v3.0 dataset with its own robot: its state and action may be shorter than the policy's,
its cameras other ones, its fps another. :func:`plan_mixture` maps every source onto one set of features (after each
source's ``rename_map``): a state or action vector is as long as the longest source's, a camera is the union of the
sources' cameras. A policy that cannot take a missing input (``PolicyConfig.pads_missing_inputs`` false: ACT,
Diffusion) is refused at start-up naming the source and the key; LeRobot's VLAs take them:

- a shorter state or action is padded (per batch, by :meth:`MixtureDataset.collate`, the DataLoader's collate
  function), and :data:`ACTION_DIM_PAD_KEY` marks the padded action dimensions, which never enter the loss (the padded
  values come out of the normaliser as 0, see ``lerobot_mg.processors.mixture``);
- a missing camera is an all-zero image, marked per sample by :func:`empty_camera_key`, which the policy masks out
  as LeRobot's VLAs do an empty camera;
- a camera whose frames are another size than the mixture's (the first source's that has it) is resized.

Each source's frames are read at its own fps: the policy's offsets in frames (the action chunk) become each source's
own ``delta_timestamps``.

:class:`MixtureSampler` draws the sources by weight: an epoch is as many draws as the mixture has frames, the source of
each position drawn from (seed, epoch) and the frame within the source from a permutation of that source's frames
(seed, epoch, source, lap), so an epoch order is a pure function of (seed, epoch): a resumed run draws the same
samples, and the resumable sampler's rule for another topology holds unchanged.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from lerobot_mg.data import cache
from lerobot_mg.data.lerobot_dataset import LeRobotDataset
from lerobot_mg.data.meta import DEFAULT_FEATURES, STATS_PATH, DatasetMeta
from lerobot_mg.data.sampler import ResumableBatchSampler
from lerobot_mg.data.stats import aggregate_stats
from lerobot_mg.errors import ConfigError, config_error
from lerobot_mg.policies.base import ACTION_DIM_PAD_KEY, SOURCE_INDEX_KEY, empty_camera_key

# The 1-D float vectors a shorter source pads: the robot's state and its action.
PADDED_KEYS = ("observation.state", "action")
_VISUAL = ("image", "video")


def source_name(repo_id: str | None, root: str | Path) -> str:
    """A source's name in logs, the ledger and file names: its repo id (``/`` -> ``_``), else its folder's name."""
    return repo_id.replace("/", "_") if repo_id else Path(root).name


@dataclass(frozen=True)
class SourcePlan:
    """One source as the mixture reads it."""

    name: str
    meta: DatasetMeta
    weight: float  # the probability of drawing from it (the weights sum to 1)
    episodes: list[int] | None
    rename: dict[str, str]  # its feature name -> the mixture's
    repo_id: str | None = None
    revision: str | None = None  # as asked for
    commit: str | None = None  # the Hub commit the files read came from (None: the directory records none)
    how: str = "root"  # root (given) | cache (LeRobot's cache) | download (fetched by this start)

    def source_key(self, key: str) -> str:
        """The source's own name of the mixture's feature ``key``."""
        return next((own for own, renamed in self.rename.items() if renamed == key), key)

    @property
    def features(self) -> dict[str, dict[str, Any]]:
        """Its features under the mixture's names."""
        return {self.rename.get(key, key): spec for key, spec in self.meta.features.items()}


@dataclass(frozen=True)
class MixturePlan:
    """The sources and the features they share, checked; what a start needs before reading a frame."""

    sources: tuple[SourcePlan, ...]
    features: dict[str, dict[str, Any]]  # the merged info.json-style features the policy is built from
    fps: int  # the first source's (simulation evaluation and the policy's config see this one)
    padded: frozenset[str] = field(default_factory=frozenset)  # PADDED_KEYS some source is shorter in
    empty_cameras: frozenset[str] = field(default_factory=frozenset)  # cameras some source lacks

    def fingerprint(self) -> str:
        """What makes the mixture's sample stream: each source's data, weight, episodes and renames, in order (not
        where it was read from)."""
        described = [[s.meta.fingerprint, s.weight, s.episodes, sorted(s.rename.items())] for s in self.sources]
        return hashlib.sha256(json.dumps(described).encode()).hexdigest()[:16]


def _check_weights(weights: list[float | None], frames: list[int]) -> list[float]:
    given = [w for w in weights if w is not None]
    for position, weight in enumerate(weights):
        if weight is not None and (not np.isfinite(weight) or weight < 0):
            raise config_error(f"dataset.sources.{position}.weight", weight, "must be a finite number >= 0",
                               f"dataset.sources.{position}.weight=<a probability, e.g. 0.5>")
    if len(given) not in (0, len(weights)):
        raise config_error("dataset.sources", [f"weight={w}" for w in weights],
                           "gives some sources a weight and others none: the shares of the others are undefined",
                           "a weight for every source, or none (each source's share of the frames)")
    resolved = [float(w) for w in weights] if given else [float(n) for n in frames]
    if sum(resolved) <= 0:
        raise config_error("dataset.sources", [f"weight={w}" for w in weights], "weights are all zero: nothing would "
                           "ever be drawn", "dataset.sources.0.weight=1 (any positive weight)")
    return [w / sum(resolved) for w in resolved]


def _check_rename(position: int, meta: DatasetMeta, rename: dict[str, str]) -> None:
    key = f"dataset.sources.{position}.rename_map"
    unknown = sorted(set(rename) - set(meta.features))
    if unknown:
        raise config_error(key, dict(rename), f"renames {unknown}, which {meta.root} does not have (its features: "
                           f"{sorted(k for k in meta.features if k not in DEFAULT_FEATURES)})",
                           f"{key}={{<a feature of the source>: <the policy's name>}}")
    fixed = sorted((set(rename) | set(rename.values())) & set(DEFAULT_FEATURES))
    if fixed:
        raise config_error(key, dict(rename), f"renames the index features {fixed}", f"{key} without {fixed}")
    targets = [rename.get(k, k) for k in meta.features]
    collided = sorted({t for t in targets if targets.count(t) > 1})
    if collided:
        raise config_error(key, dict(rename), f"maps two features of {meta.root} onto {collided}",
                           f"{key} with a distinct name per feature")


def _merge_features(sources: Sequence[SourcePlan]) -> tuple[dict[str, dict[str, Any]], frozenset[str]]:
    """The mixture's features: the union of the sources' (renamed), each key's spec from the first source that has
    it, a padded vector as long as the longest source's; and the keys some source pads."""
    merged: dict[str, dict[str, Any]] = {}
    padded = set()
    for position, source in enumerate(sources):
        for key, spec in source.features.items():
            first = merged.get(key)
            if first is None:
                merged[key] = dict(spec)
                continue
            kinds = {first["dtype"] in _VISUAL, spec["dtype"] in _VISUAL}
            if len(kinds) > 1 or (first["dtype"] not in _VISUAL and first["dtype"] != spec["dtype"]):
                raise config_error(f"dataset.sources.{position}", source.name,
                                   f"holds {key} as {spec['dtype']}, another source as {first['dtype']}",
                                   f"dataset.sources.{position}.rename_map={{{source.source_key(key)}: <another name>}}")
            if first["dtype"] in _VISUAL:
                if _chw(spec)[0] != _chw(first)[0]:
                    raise config_error(f"dataset.sources.{position}", source.name,
                                       f"holds {key} with {_chw(spec)[0]} channels, another source with "
                                       f"{_chw(first)[0]}", f"dataset.sources.{position}.rename_map="
                                       f"{{{source.source_key(key)}: <another camera name>}}")
            elif list(spec["shape"]) != list(first["shape"]):
                if key not in PADDED_KEYS or len(spec["shape"]) != 1 or len(first["shape"]) != 1:
                    raise config_error(f"dataset.sources.{position}", source.name,
                                       f"holds {key} of shape {spec['shape']}, another source {first['shape']}; only "
                                       f"the state and action vectors ({', '.join(PADDED_KEYS)}) are padded",
                                       f"dataset.sources.{position}.rename_map={{{source.source_key(key)}: "
                                       "<another name>}, or policy.observation_keys without it")
                if spec["shape"][0] > first["shape"][0]:
                    merged[key] = dict(spec)
                padded.add(key)
    return merged, frozenset(padded)


def plan_mixture(dataset_cfg: Any, metas: Sequence[DatasetMeta], policy_cfg: Any,
                 found: Sequence[Any] | None = None) -> MixturePlan:
    """Check ``dataset.sources`` (read as ``metas``, in order) against each other and the policy; the plan.

    Refused, each with the source named: a negative or all-zero weight, two sources that are the same dataset, a
    dataset of another LeRobot version than the first, a rename of a feature the source lacks or onto a name taken,
    a feature held as an image by one source and a number by another, and, for a policy that cannot take a missing
    input, a source without one of its inputs or with another state or action size."""
    sources_cfg = list(dataset_cfg.sources)
    found = list(found) if found is not None else [None] * len(metas)  # each source's DatasetSource (data.hub)
    weights = _check_weights([s.weight for s in sources_cfg],
                             [sum(meta.lengths(s.episodes).values()) for s, meta in zip(sources_cfg, metas)])
    names: list[str] = []
    seen: dict[str, list[tuple[int, set[int]]]] = {}  # data fingerprint -> (position, episodes) of its sources
    version = str(metas[0].info.get("codebase_version"))
    plans = []
    for position, (source, meta) in enumerate(zip(sources_cfg, metas)):
        key = f"dataset.sources.{position}"
        episodes = set(meta.lengths(source.episodes))
        for other, other_episodes in seen.setdefault(meta.fingerprint, []):  # the same data, wherever it was read
            shared = sorted(episodes & other_episodes)
            if shared:
                raise config_error(
                    key, source.repo_id or source.root,
                    f"is the same dataset as dataset.sources.{other} and shares its episodes {shared[:10]}"
                    f"{' ...' if len(shared) > 10 else ''}: they would be drawn at both sources' weights",
                    f"dataset.sources.{position}.episodes=<episodes dataset.sources.{other} does not read>, or drop it "
                    f"and raise dataset.sources.{other}.weight")
        seen[meta.fingerprint].append((position, episodes))
        if str(meta.info.get("codebase_version")) != version:
            raise config_error(key, source.repo_id or source.root,
                               f"is a LeRobot {meta.info.get('codebase_version')} dataset, dataset.sources.0 a "
                               f"{version} one: one reader reads them all only at one version",
                               "convert the older one with LeRobot's conversion script, or drop it")
        rename = dict(source.rename_map or {})
        _check_rename(position, meta, rename)
        if "action" not in meta.features:
            raise config_error(key, source.repo_id or source.root, "records no action, which every source of a "
                               "mixture trains the policy to predict", f"drop dataset.sources.{position}")
        name = source_name(source.repo_id, meta.root)
        while name in names:  # unique: the ledger, compare and the processor files are keyed by it
            name = f"{name}_{position}"
        names.append(name)
        where = found[position]
        plans.append(SourcePlan(name, meta, weights[position], None if source.episodes is None else list(source.episodes),
                                rename, source.repo_id, source.revision, where and where.commit,
                                where.how if where else "root"))
    features, padded = _merge_features(plans)
    cameras = {k for k, spec in features.items() if spec["dtype"] in _VISUAL}
    empty = frozenset(k for k in cameras if any(k not in plan.features for plan in plans))
    plan = MixturePlan(tuple(plans), features, metas[0].fps, padded, empty)
    _refuse_missing_inputs(plan, policy_cfg)
    return plan


def _refuse_missing_inputs(plan: MixturePlan, policy_cfg: Any) -> None:
    """Every source has each input of a policy that cannot pad or mask (ACT, Diffusion), at the same size; for one
    that can (the VLAs), each of its vector inputs (a camera a source lacks is an empty one)."""
    observed = policy_cfg.observation_keys or [k for k in plan.features if k.startswith("observation.")]
    pads = policy_cfg.pads_missing_inputs
    for missing in (True, False):  # a missing input first: it is the more basic problem
        for position, source in enumerate(plan.sources):
            for key in [*observed, "action"]:
                if pads and (not missing or plan.features.get(key, {}).get("dtype") in _VISUAL):
                    continue
                spec = source.features.get(key)
                without = "policy.observation_keys without it, " if key != "action" else ""
                if missing and spec is None:
                    raise config_error(f"dataset.sources.{position}", source.name, f"has no {key}, which "
                                       f"policy.type={policy_cfg.type} reads and cannot do without"
                                       + (" (a missing camera is an empty image; a missing vector has no stand-in)"
                                          if pads else ""),
                                       f"dataset.sources.{position}.rename_map={{<its name for it>: {key}}}, {without}"
                                       "or a policy that pads missing inputs (policy=pi0, pi05 or smolvla)")
                if (not missing and spec["dtype"] not in _VISUAL
                        and list(spec["shape"]) != list(plan.features[key]["shape"])):
                    raise config_error(f"dataset.sources.{position}", source.name,
                                       f"holds {key} of shape {spec['shape']}, another source "
                                       f"{plan.features[key]['shape']}; policy.type={policy_cfg.type} cannot pad it",
                                       f"a policy that pads (policy=pi0, pi05 or smolvla), {without}or drop "
                                       f"dataset.sources.{position}")


class MixtureDataset(torch.utils.data.Dataset):
    """The frames of every source, one after the other (source ``s`` holds global indices ``offset[s]`` up to
    ``offset[s] + len(source)``), in the mixture's feature names, with their global ``index`` and
    :data:`SOURCE_INDEX_KEY`. An item keeps its source's own state and action length; :meth:`collate` (the
    DataLoader's ``collate_fn``) pads a batch's to the mixture's in one go, marks the padded action dimensions and
    maps each sample into the normaliser's statistics with its source's map (:meth:`set_normalisation`, given by the
    start once the normaliser exists: ``lerobot_mg.processors.mixture``). ``stats``: the sources' merged statistics,
    for the normaliser."""

    def __init__(self, plan: MixturePlan, delta_timestamps: Callable[[int], dict[str, list[float]]],
                 keys: Collection[str], uint8_visuals: bool = True) -> None:
        self.plan = plan
        self.features = plan.features
        self.keys = [k for k in keys if k in plan.features]
        self.datasets: list[LeRobotDataset] = []
        for source in plan.sources:
            deltas = {source.source_key(k): v for k, v in delta_timestamps(source.meta.fps).items()
                      if k in source.features}
            own_keys = [source.source_key(k) for k in self.keys if k in source.features]
            self.datasets.append(LeRobotDataset(source.meta, deltas, source.episodes, keys=own_keys,
                                                uint8_visuals=uint8_visuals))
        self.deltas = delta_timestamps(plan.fps)
        lengths = np.array([len(d) for d in self.datasets], dtype=np.int64)
        self.offsets = np.r_[0, np.cumsum(lengths)[:-1]].astype(np.int64)
        self._offsets = self.offsets.tolist()  # bisect on a list: a numpy search costs more than it saves per item
        self.num_frames = int(lengths.sum())
        self.weights = np.array([s.weight for s in plan.sources], dtype=np.float64)
        self.visual_keys = [k for k in self.keys if plan.features[k]["dtype"] in _VISUAL]
        self.uint8_visuals = uint8_visuals
        # Per source: its renames with their _is_pad companions, its position as a tensor, its missing cameras' flags.
        self._renames = [{**source.rename, **{f"{own}_is_pad": f"{new}_is_pad" for own, new in source.rename.items()}}
                         for source in plan.sources]
        self._source_index = [torch.tensor(s, dtype=torch.int64) for s in range(len(plan.sources))]
        self._pad_keys = [k for k in PADDED_KEYS if k in plan.padded and k in self.keys]
        self._maps: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        if "action" in self._pad_keys:  # (sources, action dims): True where a source's action has no such dimension
            own = torch.tensor([int(source.features["action"]["shape"][0]) for source in plan.sources])
            self._action_dim_pad = torch.arange(int(self.features["action"]["shape"][0]))[None, :] >= own[:, None]
        # Each source's statistics of the features read, under the mixture's names; the normaliser's are their merge
        # (LeRobot's aggregate_stats, a shorter vector's dimensions merged over the sources that have them).
        self.source_stats = [{source.rename.get(key, key): value for key, value in dataset.stats.items()
                              if source.rename.get(key, key) in self.keys}
                             for source, dataset in zip(plan.sources, self.datasets)]
        for position, (source, stats) in enumerate(zip(plan.sources, self.source_stats)):
            for key in [k for k in self.keys if self.features[k]["dtype"] not in _VISUAL and k in source.features]:
                if key not in stats or np.shape(stats[key].get("mean", []))[-1:] != tuple(source.features[key]["shape"]):
                    raise config_error(f"dataset.sources.{position}", source.name,
                                       f"has no statistics of {key} in {source.meta.root / STATS_PATH} (or of another "
                                       "size than the feature), and each source's samples are normalised with them",
                                       "compute the dataset's statistics (LeRobot writes meta/stats.json when it "
                                       "records or edits a dataset)")
        self.stats = {key: {name: torch.as_tensor(value, dtype=torch.float32) for name, value in per_key.items()}
                      for key, per_key in aggregate_stats(self.source_stats).items()}
        self.cache_dir = cache.cache_root(f"mixture-{plan.fingerprint()}")

    def set_normalisation(self, maps: Sequence[Any]) -> None:
        """Each source's map into the normaliser's statistics: per source, an object with ``offset``, ``scale`` and
        ``shift`` dicts of float32 vectors of the mixture's lengths (``lerobot_mg.processors.mixture.SourceAffine``);
        :meth:`collate` computes ``(x - offset) * scale + shift`` of each sample with its source's. Set before the
        DataLoader's workers start."""
        self._maps = {key: tuple(torch.from_numpy(np.stack([getattr(m, part)[key] for m in maps]))
                                 for part in ("offset", "scale", "shift"))
                      for key in maps[0].scale} if maps else {}

    def __len__(self) -> int:
        return self.num_frames

    def fingerprint(self) -> str:
        return self.plan.fingerprint()

    def source_of(self, indices: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.offsets, indices, side="right") - 1

    def locate(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source position, the source's episode index) of each index the sampler yields (a presentation: see
        :meth:`__getitem__`)."""
        indices = np.asarray(indices, dtype=np.int64) % self.num_frames
        sources = self.source_of(indices)
        episodes = np.empty_like(indices)
        for s in np.unique(sources).tolist():
            chosen = sources == s
            dataset = self.datasets[s]
            position = np.searchsorted(dataset._first, indices[chosen] - self.offsets[s], side="right") - 1
            episodes[chosen] = np.asarray(dataset._episode_order)[position]
        return sources, episodes

    def facts(self) -> list[dict[str, Any]]:
        """Each source as a run records it (RunFacts.mixture, the ledger, the banner)."""
        return [{"name": s.name, "root": str(s.meta.root), "repo_id": s.repo_id, "revision": s.revision,
                 "commit": s.commit, "how": s.how, "fingerprint": s.meta.fingerprint, "weight": s.weight, "num_frames": len(d),
                 "num_episodes": d.num_episodes, "fps": s.meta.fps}
                for s, d in zip(self.plan.sources, self.datasets)]

    def __getitem__(self, idx: int) -> dict[str, Any]:
        """Frame ``idx % len(self)`` of the mixture. ``idx // len(self)`` is the lap of a source drawn more often
        in an epoch than it has frames (:class:`MixtureSampler`): the item's ``index`` is ``idx`` itself, so each
        presentation of a frame gets its own per-sample seed (``lerobot_mg.data.sampler.sample_seeds``)."""
        if idx < 0:
            raise IndexError(f"index {idx} is negative.")
        frame = idx % self.num_frames
        s = bisect.bisect_right(self._offsets, frame) - 1
        item = self.datasets[s][frame - self._offsets[s]]
        renames = self._renames[s]
        if renames:
            item = {renames.get(key, key): value for key, value in item.items()}
        item["index"] = torch.tensor(idx, dtype=torch.int64)
        item[SOURCE_INDEX_KEY] = self._source_index[s]
        for key in self.visual_keys:
            if key in self.plan.empty_cameras:
                item[empty_camera_key(key)] = torch.tensor(key not in item)
            item[key] = self._frames(key, item.get(key))
            if key in self.deltas and f"{key}_is_pad" not in item:
                item[f"{key}_is_pad"] = torch.zeros(len(self.deltas[key]), dtype=torch.bool)
        return item

    def collate(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        """A batch of items: each padded state and action at the mixture's length (zeros beyond its source's, marked
        for the action by :data:`ACTION_DIM_PAD_KEY`), then each sample mapped with its source's normalisation map."""
        padded = {}
        for key in self._pad_keys:
            values = [item.pop(key, None) for item in items]
            like = values[0]  # every source has each padded key (plan_mixture refuses one that lacks it)
            out = torch.zeros((len(items), *like.shape[:-1], int(self.features[key]["shape"][0])), dtype=like.dtype)
            rows_of: dict[int, list[int]] = {}  # the rows of each length: one copy per length, not per row
            for row, value in enumerate(values):
                rows_of.setdefault(value.shape[-1], []).append(row)
            for length, rows in rows_of.items():
                out[rows, ..., :length] = torch.stack([values[row] for row in rows])
            padded[key] = out
        batch = torch.utils.data.default_collate(items)
        batch.update(padded)
        source = batch[SOURCE_INDEX_KEY]
        if "action" in self._pad_keys:
            batch[ACTION_DIM_PAD_KEY] = self._action_dim_pad[source]
        for key, (offset, scale, shift) in self._maps.items():
            if key in batch:
                value = batch[key]
                view = (len(source), *([1] * (value.dim() - 2)), -1)  # one map per sample, along the last axis
                batch[key] = (value - offset[source].view(view)) * scale[source].view(view) + shift[source].view(view)
        return batch

    def _frames(self, key: str, frames: torch.Tensor | None) -> torch.Tensor:
        """The source's frames of camera ``key`` at the mixture's size (resized when its own differ), or zeros where
        the source has no such camera."""
        c, h, w = _chw(self.features[key])
        steps = (len(self.deltas[key]),) if key in self.deltas else ()
        dtype = torch.uint8 if self.uint8_visuals else torch.float32
        if frames is None:
            return torch.zeros((*steps, c, h, w), dtype=dtype)
        if tuple(frames.shape[-2:]) == (h, w):
            return frames
        flat = frames.reshape(-1, *frames.shape[-3:]).float()
        resized = F.interpolate(flat, size=(h, w), mode="bilinear", align_corners=False, antialias=True)
        if self.uint8_visuals:
            resized = resized.round_().clamp_(0, 255).to(torch.uint8)
        return resized.reshape(*frames.shape[:-2], h, w)


def _chw(spec: dict[str, Any]) -> tuple[int, int, int]:
    """(channels, height, width) of a camera feature, from its shape and names as LeRobot writes them."""
    shape = [int(v) for v in spec["shape"]]
    names = spec.get("names") or []
    if len(names) == 3 and str(names[0]).lower() in ("channel", "channels", "c"):
        return shape[0], shape[1], shape[2]
    return shape[2], shape[0], shape[1]


class MixtureSampler(ResumableBatchSampler):
    """The resumable sampler over a mixture: each epoch's order draws the sources by weight (module docstring)."""

    def __init__(self, dataset: MixtureDataset, batch_size: int, seed: int, rank: int = 0, world_size: int = 1) -> None:
        super().__init__(len(dataset), batch_size, seed, rank, world_size, shuffle=True, cache_dir=dataset.cache_dir)
        self.weights = torch.from_numpy(dataset.weights)
        self.offsets = dataset.offsets.tolist()
        self.lengths = [len(d) for d in dataset.datasets]
        self.mixture = dataset.fingerprint()

    def _draw(self, epoch: int) -> torch.Tensor:
        mixed = int(np.random.SeedSequence([self.seed, epoch]).generate_state(1, dtype=np.uint64)[0])
        sources = torch.multinomial(self.weights, self.num_samples, replacement=True,
                                    generator=torch.Generator().manual_seed(mixed))
        order = torch.empty(self.num_samples, dtype=torch.int64)
        for s, (offset, length) in enumerate(zip(self.offsets, self.lengths)):
            positions = torch.nonzero(sources == s).flatten()
            laps = []
            for lap in range(-(-len(positions) // length)):
                lap_seed = int(np.random.SeedSequence([self.seed, epoch, s, lap]).generate_state(1, dtype=np.uint64)[0])
                # Lap k of the source yields k * N + its global index: a frame drawn again is another presentation.
                laps.append(torch.randperm(length, generator=torch.Generator().manual_seed(lap_seed))
                            + (offset + lap * self.num_samples))
            if laps:
                order[positions] = torch.cat(laps)[: len(positions)]
        return order

    def global_window(self) -> np.ndarray:
        """The indices (presentations, see :meth:`MixtureDataset.__getitem__`) the next loop step consumes, every
        rank's micro-batch in rank order."""
        return self.permutation(self.epoch)[self.offset: self.offset + self.global_batch_size].numpy()

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "mixture": self.mixture}

    def load_state_dict(self, state: dict[str, Any]) -> str:
        if state.get("mixture") != self.mixture:
            raise ConfigError(
                f"dataset.sources: the checkpoint's sampler drew from another mixture ({state.get('mixture')}, this run's "
                f"is {self.mixture}): other sources, weights, episodes or renames. Fix: resume with the saved run's "
                "dataset.sources, or start a new run (a fine-tune: policy.path=<its pretrained_model>)"
            )
        return super().load_state_dict(state)
