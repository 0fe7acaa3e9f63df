"""The training/validation split of a dataset's episodes (``dataset.episodes``, ``dataset.val_episodes``).

``dataset.val_episodes`` holds episodes out of training: a list of episode indices, or a count N, which names the
dataset's last N episodes (by episode index). The held-out episodes never reach the training sampler; the
validation loss is evaluated on them (lerobot_mg.evaluation). With ``dataset.episodes`` set, training reads those
episodes and the held-out ones must lie outside them; without it, training reads every other episode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lerobot_mg.data.meta import DatasetMeta
from lerobot_mg.errors import config_error


@dataclass(frozen=True)
class EpisodeSplit:
    """Which episodes train and which are held out. ``train`` None: every episode (nothing held out)."""

    train: list[int] | None
    val: list[int]

    @property
    def has_validation(self) -> bool:
        return bool(self.val)


def split_episodes(meta: DatasetMeta, episodes: list[int] | None, val_episodes: Any) -> EpisodeSplit:
    """The split that ``dataset.episodes`` and ``dataset.val_episodes`` (already type-checked by
    config.validate) ask of ``meta``'s dataset; a ConfigError when the held-out episodes are unknown, overlap the
    training selection, or leave nothing to train on."""
    if val_episodes is None:
        return EpisodeSplit(None if episodes is None else list(episodes), [])
    available = meta.episodes.column("episode_index").to_pylist()
    if isinstance(val_episodes, int):
        if val_episodes >= len(available):
            raise config_error("dataset.val_episodes", val_episodes,
                               f"holds out every episode of dataset.root (it has {len(available)}): nothing is left "
                               "to train on", f"dataset.val_episodes=<at most {len(available) - 1}>")
        val = sorted(available)[-val_episodes:]
    else:
        val = sorted(set(int(episode) for episode in val_episodes))
        unknown = sorted(set(val) - set(available))
        if unknown:
            raise config_error("dataset.val_episodes", val_episodes,
                               f"dataset.root has no episode {unknown} (it has {len(available)}: "
                               f"{min(available)}..{max(available)})",
                               f"dataset.val_episodes=<indices in {min(available)}..{max(available)}>, or a count")
    if episodes is not None:
        overlap = sorted(set(episodes) & set(val))
        if overlap:
            raise config_error("dataset.val_episodes", val_episodes,
                               f"holds out episodes {overlap}, which dataset.episodes trains on",
                               "dataset.val_episodes=<episodes outside dataset.episodes>, or drop them from "
                               "dataset.episodes")
        return EpisodeSplit(list(episodes), val)
    train = sorted(set(available) - set(val))
    if not train:
        raise config_error("dataset.val_episodes", val_episodes,
                           f"holds out every episode of dataset.root (it has {len(available)}): nothing is left to "
                           "train on", "dataset.val_episodes=<fewer episodes>")
    return EpisodeSplit(train, val)
