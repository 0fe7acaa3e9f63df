"""dataset=mixture's config surface through Hydra's real composition: the list of sources typed on the command line
(as one quoted argument) becomes typed ``SourceConfig`` objects, one source's field is overridden by its position,
a multirun sweeps one source's weight (Hydra's own sweeper expands it into one typed config per point), and
``dataset.stats`` takes its two words and refuses any other on one line."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import ConfigCompositionException

from lerobot_mg.config import register_configs
from lerobot_mg.config.choices import DatasetName, MixtureStats
from lerobot_mg.config.loading import (
    CONF_DIR,
    check_choices,
    check_presets,
    choice_error_of,
    override_keys,
    run_config,
)
from lerobot_mg.config.schema import SourceConfig, TrainConfig
from lerobot_mg.data.meta import DatasetMeta
from lerobot_mg.data.mixture import plan_mixture
from lerobot_mg.errors import ConfigError
from tests.launch_utils import PUSHT_SLICE

# The command line: two sources, the second's camera renamed to the policy's name for it.
SOURCES = ("dataset.sources=[{root: /data/a, weight: 0.7}, "
           "{root: /data/b, weight: 0.3, rename_map: {observation.image: observation.images.top}}]")
MIXTURE = ["dataset=mixture", SOURCES]


def _typed(overrides: list[str]) -> TrainConfig:
    """What a launch runs for ``overrides``: the CLI's checks before Hydra composes, then the typed run config."""
    check_presets(overrides)
    check_choices(overrides)
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        composed = compose(config_name="train", overrides=overrides)
    return run_config(composed, frozenset(override_keys(overrides)))


def test_the_list_override_becomes_typed_sources() -> None:
    dataset = _typed(MIXTURE).dataset
    assert dataset.name == DatasetName.mixture and dataset.root is None and dataset.repo_id is None
    assert dataset.sources == [
        SourceConfig(root="/data/a", weight=0.7),
        SourceConfig(root="/data/b", weight=0.3, rename_map={"observation.image": "observation.images.top"}),
    ]
    assert all(isinstance(source, SourceConfig) for source in dataset.sources)
    assert dataset.stats == MixtureStats.merged  # the default: one set of statistics over every source
    # A Hub source at a revision, with episodes and no weight (its share of the frames).
    hub = _typed(["dataset=mixture", "dataset.sources=[{repo_id: lerobot/pusht, revision: v3.0, episodes: [0, 2]}]"])
    assert hub.dataset.sources == [SourceConfig(repo_id="lerobot/pusht", revision="v3.0", episodes=[0, 2])]


def test_one_source_is_overridden_by_its_position() -> None:
    sources = _typed([*MIXTURE, "dataset.sources.0.weight=0.5"]).dataset.sources
    assert [source.weight for source in sources] == [0.5, 0.3]
    assert sources[1].rename_map == {"observation.image": "observation.images.top"}  # the other source untouched
    renamed = _typed([*MIXTURE, "dataset.sources.1.rename_map={observation.image: observation.images.side}"])
    assert renamed.dataset.sources[1].rename_map == {"observation.image": "observation.images.side"}


def test_a_typo_or_a_wrong_type_in_a_source_fails_at_compose_time() -> None:
    with pytest.raises(ConfigCompositionException) as typo:
        _typed(["dataset=mixture", "dataset.sources=[{root: /data/a, wieght: 0.7}]"])
    assert "Key 'wieght' not in 'SourceConfig'" in str(typo.value.__cause__)
    with pytest.raises(ConfigCompositionException) as wrong:
        _typed(["dataset=mixture", "dataset.sources=[{root: /data/a, weight: much}]"])
    assert "Value 'much' of type 'str' could not be converted to Float" in str(wrong.value.__cause__)


def test_a_multirun_sweeps_one_source_weight_into_one_config_per_point() -> None:
    """``-m dataset.sources.0.weight=0.2,0.8``: Hydra's basic sweeper (the local one, and the one the SLURM
    launcher is handed the same jobs by) expands the command line into two jobs, each composed as a run."""
    typed = [*MIXTURE, "dataset.sources.0.weight=0.2,0.8"]
    check_presets(typed)
    check_choices(typed)  # the CLI's checks before Hydra take a sweep as they take one value
    (jobs,) = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(typed), max_batch_size=None)
    assert len(jobs) == 2
    sources = [_typed(job).dataset.sources for job in jobs]
    assert [[source.weight for source in point] for point in sources] == [[0.2, 0.3], [0.8, 0.3]]
    assert all(point[1].rename_map == {"observation.image": "observation.images.top"} for point in sources)


def test_stats_takes_its_two_words_and_refuses_another_on_one_line() -> None:
    assert _typed([*MIXTURE, "dataset.stats=per_source"]).dataset.stats == MixtureStats.per_source
    for typed in ("dataset.stats=pooled", "dataset.stats=merged,pooled"):  # one value, and a sweep's
        with pytest.raises(ConfigError) as refused:
            check_choices([*MIXTURE, typed])
        assert str(refused.value) == "dataset.stats='pooled': must be one of merged, per_source. Fix: dataset.stats=merged"
    # Composed without the CLI's check first, Hydra's refusal translates to the same line.
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        with pytest.raises(ConfigCompositionException) as composed:
            compose(config_name="train", overrides=[*MIXTURE, "dataset.stats=Per_Source"])
    translated = choice_error_of(composed.value, "dataset.stats")
    assert str(translated) == ("dataset.stats='Per_Source': must be one of merged, per_source. "
                               "Fix: dataset.stats=per_source")


def test_a_source_without_a_weight_is_drawn_by_its_share_of_the_frames() -> None:
    """weight null on every source: each source's share of the mixture's frames (here the PushT slice's episodes
    0 and 1 against episode 2)."""
    cfg = _typed(["dataset=mixture", "policy.observation_keys=[observation.state]",
                  f"dataset.sources=[{{root: {PUSHT_SLICE}, episodes: [0, 1]}}, {{root: {PUSHT_SLICE}, episodes: [2]}}]"])
    meta = DatasetMeta.read(PUSHT_SLICE)
    frames = [sum(meta.lengths(episodes).values()) for episodes in ([0, 1], [2])]
    plan = plan_mixture(cfg.dataset, [meta, meta], cfg.policy)
    assert [source.weight for source in plan.sources] == pytest.approx([n / sum(frames) for n in frames])
    assert frames[0] != frames[1]  # the shares differ from an even split
    assert [source.name for source in plan.sources] == ["pusht_image_slice", "pusht_image_slice_1"]
