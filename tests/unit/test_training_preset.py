"""LeRobot's training recipe (``use_policy_training_preset``, lerobot_mg.config.recipe): each policy's optimizer and
lr schedule, keys the config sets winning over them, the defaults without them, LeRobot's schedules number for
number, and a resume keeping the recipe it recorded."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from diffusers.optimization import (
    get_cosine_schedule_with_warmup,  # what LeRobot's `diffuser` scheduler builds
)
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file

from lerobot_mg.config.loading import (
    CONF_DIR,
    merge_resume_config,
    override_keys,
    run_config,
    train_config_to_dict,
)
from lerobot_mg.config.recipe import (
    DEFAULT_OPTIMIZER,
    OptimizerConfig,
    SchedulerConfig,
    TrainingPreset,
    resolve_recipe,
)
from lerobot_mg.config.schema import POLICY_CONFIGS, TrainConfig, register_configs
from lerobot_mg.optim import apply_optimizer_config, lr_factor, make_optimizer, make_scheduler
from lerobot_mg.policies.act import ACTPolicy
from tests.launch_utils import PUSHT_SLICE, TINY_RUN, run_train
from tests.unit.test_act import IMAGE_INPUTS, OUTPUTS, tiny_config

VALID = [f"dataset.root={PUSHT_SLICE}"]


def _run_config(typed: list[str]) -> TrainConfig:
    """The config a launch with ``typed`` on its command line runs (a resume merged with its saved config)."""
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        composed = compose(config_name="train", overrides=typed)
    if composed.resume:
        composed = merge_resume_config(composed, typed)
    return run_config(composed, frozenset(override_keys(typed)))


def _groups(optimizer: torch.optim.Optimizer) -> dict[str, dict]:
    return {group["name"]: group for group in optimizer.param_groups}


# LeRobot 0.6.1's presets (get_optimizer_preset / get_scheduler_preset with each config's defaults): optimizer type,
# lr, betas, eps, weight decay, clip; scheduler type, warm-up, decay steps, decay lr.
LEROBOT_PRESETS = {
    "act": ("adamw", 1e-5, [0.9, 0.999], 1e-8, 1e-4, 10.0, "none", None, None, None),
    "diffusion": ("adam", 1e-4, [0.95, 0.999], 1e-8, 1e-6, 10.0, "diffuser_cosine", 500, None, None),
    "pi0": ("adamw", 2.5e-5, [0.9, 0.95], 1e-8, 0.01, 1.0, "cosine_decay_with_warmup", 1000, 30_000, 2.5e-6),
    "pi05": ("adamw", 2.5e-5, [0.9, 0.95], 1e-8, 0.01, 1.0, "cosine_decay_with_warmup", 1000, 30_000, 2.5e-6),
    "smolvla": ("adamw", 1e-4, [0.9, 0.95], 1e-8, 1e-10, 10.0, "cosine_decay_with_warmup", 1000, 30_000, 2.5e-6),
}


@pytest.mark.parametrize("policy", sorted(POLICY_CONFIGS))
def test_every_policy_has_lerobots_preset(policy: str) -> None:
    assert policy in LEROBOT_PRESETS, f"policy={policy}: add its LeRobot training preset to LEROBOT_PRESETS"
    preset = POLICY_CONFIGS[policy]().training_preset()
    opt, sched = preset.optimizer, preset.scheduler
    assert (opt.type, opt.lr, list(opt.betas), opt.eps, opt.weight_decay, opt.grad_clip_norm, sched.type,
            sched.num_warmup_steps, sched.num_decay_steps, sched.decay_lr) == LEROBOT_PRESETS[policy]
    assert opt.param_groups is not None  # every optimizer key is the preset's, none falls back to ours


def test_act_trains_its_backbone_as_a_parameter_group_of_its_own() -> None:
    cfg = _run_config(VALID)
    policy = ACTPolicy(tiny_config(), IMAGE_INPUTS, OUTPUTS)
    optimizer = make_optimizer(policy, cfg.optimizer)
    assert type(optimizer) is torch.optim.AdamW and cfg.optimizer.grad_clip_norm == 10.0
    groups = _groups(optimizer)
    assert list(groups) == ["main", "model.backbone."]
    backbone = {id(p) for name, p in policy.named_parameters() if name.startswith("model.backbone.")}
    assert backbone and {id(p) for p in groups["model.backbone."]["params"]} == backbone
    assert len(groups["main"]["params"]) + len(backbone) == len(list(policy.parameters()))
    for group in groups.values():  # LeRobot's ACT: lr 1e-5, its backbone at optimizer_lr_backbone 1e-5, wd 1e-4
        assert (group["lr"], group["weight_decay"], group["betas"], group["eps"]) == (1e-5, 1e-4, (0.9, 0.999), 1e-8)
    assert cfg.scheduler.type == "none" and make_scheduler(optimizer, cfg.scheduler, cfg.steps) is None
    assert cfg.training_recipe.preset == "act"
    assert cfg.recipe_lines() == [
        "optimizer: AdamW lr 1e-05 betas (0.9, 0.999) eps 1e-08 wd 0.0001, clip 10, parameters matching "
        "'model.backbone.': lr 1e-05 wd 0.0001 (policy preset act)",
        "scheduler: none (lr constant), stepped once per loop step (policy preset act)",
    ]

    # The preset reads the policy's LeRobot fields, as LeRobot's does.
    cfg = _run_config([*VALID, "policy.optimizer_lr_backbone=2e-5", "policy.optimizer_lr=3e-5"])
    groups = _groups(make_optimizer(policy, cfg.optimizer))
    assert (groups["main"]["lr"], groups["model.backbone."]["lr"]) == (3e-5, 2e-5)


def test_diffusion_takes_lerobots_adam_betas_and_warmup() -> None:
    cfg = _run_config([*VALID, "policy=diffusion", "steps=5000"])
    opt = cfg.optimizer
    assert (opt.type, opt.lr, opt.betas, opt.eps, opt.weight_decay, opt.grad_clip_norm, opt.param_groups) == (
        "adam", 1e-4, [0.95, 0.999], 1e-8, 1e-6, 10.0, [])
    assert (cfg.scheduler.type, cfg.scheduler.num_warmup_steps) == ("diffuser_cosine", 500)
    assert type(make_optimizer(torch.nn.Linear(2, 2), opt)) is torch.optim.Adam  # L2 penalty, not AdamW's decay
    # Like any warm-up the config does not set, it takes at most a tenth of a shorter run.
    assert _run_config([*VALID, "policy=diffusion", "steps=2000"]).scheduler.num_warmup_steps == 200


def test_diffuser_cosine_is_diffusers_schedule() -> None:
    steps, warmup = 60, 7
    scheduler = SchedulerConfig(type="diffuser_cosine", num_warmup_steps=warmup)
    reference = get_cosine_schedule_with_warmup(torch.optim.SGD([torch.zeros(1)], lr=1.0), warmup, steps)
    for step in range(steps + 3):
        assert lr_factor(scheduler, 1e-4, step, steps) == pytest.approx(reference.lr_lambdas[0](step), abs=1e-15)


def test_an_optimizer_key_the_config_sets_wins_over_the_preset() -> None:
    cfg = _run_config([*VALID, "optimizer.lr=3e-4"])
    assert (cfg.optimizer.lr, cfg.optimizer.weight_decay, cfg.scheduler.type) == (3e-4, 1e-4, "none")
    groups = _groups(make_optimizer(ACTPolicy(tiny_config(), IMAGE_INPUTS, OUTPUTS), cfg.optimizer))
    assert (groups["main"]["lr"], groups["model.backbone."]["lr"]) == (3e-4, 1e-5)  # the backbone keeps its own
    assert cfg.recipe_lines()[0].endswith("(policy preset act; optimizer.lr set by the config)")
    assert "optimizer.lr" in cfg.training_recipe.config_keys and "optimizer.lr" not in cfg.training_recipe.preset_keys

    # A scheduler preset chosen by name is the config's; its keys it leaves unset still come from the policy.
    cfg = _run_config([*VALID, "policy=diffusion", "scheduler=cosine", "steps=5000"])
    assert (cfg.scheduler.type, cfg.scheduler.num_warmup_steps, cfg.optimizer.type) == ("cosine", 500, "adam")
    assert cfg.recipe_lines()[1].endswith("(policy preset diffusion; scheduler.type set by the config)")


@pytest.mark.parametrize("policy", ["act", "diffusion"])
def test_use_policy_training_preset_false_restores_the_optimizer_defaults(policy: str) -> None:
    cfg = _run_config([*VALID, f"policy={policy}", "use_policy_training_preset=false"])
    assert cfg.optimizer == DEFAULT_OPTIMIZER
    assert (cfg.scheduler.type, cfg.scheduler.num_warmup_steps, cfg.scheduler.min_lr_ratio) == ("cosine", 100, 0.1)
    assert cfg.training_recipe.preset is None
    assert [line.rsplit(" (", 1)[1] for line in cfg.recipe_lines()] == ["lerobot_mg's defaults)"] * 2
    assert len(make_optimizer(ACTPolicy(tiny_config(), IMAGE_INPUTS, OUTPUTS), cfg.optimizer).param_groups) == 1


def _lerobot_cosine_decay_with_warmup(step: int, warmup: int, decay: int, peak_lr: float, decay_lr: float,
                                      steps: int) -> float:
    """LeRobot 0.6.1's CosineDecayWithWarmupSchedulerConfig (lerobot/optim/schedulers.py), transcribed: the lr at
    ``step`` of a ``steps`` run."""
    if steps < decay:
        warmup, decay = int(warmup * (steps / decay)), steps
    if step < warmup:
        if step <= 0:
            factor = 1 / (warmup + 1)
        else:
            factor = (1 / (warmup + 1) - 1) * (1 - step / warmup) + 1
    else:
        cosine = 0.5 * (1 + math.cos(math.pi * min(step, decay) / decay))
        alpha = decay_lr / peak_lr
        factor = (1 - alpha) * cosine + alpha
    return peak_lr * factor


# pi0 / SmolVLA's schedule (1000 / 30000 down to 2.5e-6) on runs shorter than the decay (scaled, as LeRobot does),
# as long, and longer; and small ones whose warm-up scales to 0 and to 1.
@pytest.mark.parametrize(("warmup", "decay", "steps"), [
    (1000, 30_000, 3000), (1000, 30_000, 30_000), (1000, 30_000, 40_000), (10, 40, 20), (10, 40, 3), (3, 5, 9)])
def test_cosine_decay_with_warmup_is_lerobots_number_for_number(warmup: int, decay: int, steps: int) -> None:
    peak_lr, decay_lr = 2.5e-5, 2.5e-6
    preset = TrainingPreset(
        replace(DEFAULT_OPTIMIZER, lr=peak_lr, betas=[0.9, 0.95], weight_decay=0.01, grad_clip_norm=1.0),
        SchedulerConfig(type="cosine_decay_with_warmup", num_warmup_steps=warmup, num_decay_steps=decay,
                        decay_lr=decay_lr))
    opt_cfg, sched_cfg, record = resolve_recipe(OptimizerConfig(), SchedulerConfig(), preset, "pi0", steps)
    assert record.preset == "pi0" and sched_cfg.num_decay_steps == min(decay, steps)  # the scaled values recorded
    model = torch.nn.Linear(2, 1)
    optimizer = make_optimizer(model, opt_cfg)
    scheduler = make_scheduler(optimizer, sched_cfg, steps)
    checked = sorted({*range(0, min(steps, 50)), *range(0, steps + 5, max(1, steps // 97)), steps - 1, steps + 4})
    lrs = {}
    for step in range(max(checked) + 1):
        lrs[step] = optimizer.param_groups[0]["lr"]
        optimizer.step()
        scheduler.step()
    for step in checked:
        expected = _lerobot_cosine_decay_with_warmup(step, warmup, decay, peak_lr, decay_lr, steps)
        assert lrs[step] == pytest.approx(expected, rel=1e-12, abs=1e-20), step
    # The recorded (scaled) config and the preset's own numbers give the same schedule.
    assert lr_factor(preset.scheduler, peak_lr, steps // 2, steps) == lr_factor(sched_cfg, peak_lr, steps // 2, steps)


def test_a_resume_keeps_the_recipe_it_recorded(tmp_path: Path) -> None:
    first = _run_config([*VALID, "optimizer.lr=3e-4"])
    saved = tmp_path / "train_config.json"
    saved.write_text(json.dumps(train_config_to_dict(first)))
    # Neither the preset's switch nor the policy's preset fields change a recorded recipe ...
    resumed = _run_config(["resume=true", f"config_path={saved}", "use_policy_training_preset=false",
                           "policy.optimizer_lr=5e-5", "policy.optimizer_lr_backbone=5e-5"])
    assert (resumed.optimizer, resumed.scheduler, resumed.training_recipe) == (
        first.optimizer, first.scheduler, first.training_recipe)
    assert resumed.recipe_lines() == first.recipe_lines()
    # ... an optimizer key on the resume command line does.
    assert _run_config(["resume=true", f"config_path={saved}", "optimizer.lr=1e-3"]).optimizer.lr == 1e-3


def test_a_resumed_optimizer_takes_each_groups_lr_from_the_config() -> None:
    policy = ACTPolicy(tiny_config(), IMAGE_INPUTS, OUTPUTS)
    cfg = _run_config([*VALID, "optimizer.lr=3e-4"])
    optimizer = make_optimizer(policy, cfg.optimizer)
    for param in policy.parameters():
        param.grad = torch.ones_like(param)
    optimizer.step()
    state = optimizer.state_dict()
    changed = replace(cfg.optimizer, lr=1e-3)
    resumed = make_optimizer(policy, changed)
    resumed.load_state_dict(state)
    apply_optimizer_config(resumed, None, changed)
    groups = _groups(resumed)
    assert (groups["main"]["lr"], groups["model.backbone."]["lr"]) == (1e-3, 1e-5)


def test_the_banner_and_the_checkpoint_show_the_recipe_trained_with(tmp_path: Path) -> None:
    """A real run on the PushT slice with its camera: ACT's preset under optimizer.lr from the command line."""
    run_dir = tmp_path / "run"
    proc = run_train([*TINY_RUN, "steps=2", "checkpoint.save_freq=2", f"output_dir={run_dir}", "optimizer.lr=3e-4",
                      "policy.observation_keys=[observation.image,observation.state]"])
    assert ("  optimizer: AdamW lr 0.0003 betas (0.9, 0.999) eps 1e-08 wd 0.0001, clip 10, parameters matching "
            "'model.backbone.': lr 1e-05 wd 0.0001 (policy preset act; optimizer.lr set by the config)") in proc.stdout
    saved = json.loads((run_dir / "train_config.json").read_text())
    assert (saved["optimizer"]["lr"], saved["optimizer"]["param_groups"][0]["lr"]) == (3e-4, 1e-5)
    assert saved["run_facts"]["lr_schedule"]["lr"] == 3e-4  # what lerobot-mg-compare reads
    assert saved["training_recipe"]["preset"] == "act"
    training_state = run_dir / "checkpoints" / "last" / "training_state"
    groups = json.loads((training_state / "optimizer_param_groups.json").read_text())
    assert [(group["name"], group["lr"]) for group in groups] == [("main", 3e-4), ("model.backbone.", 1e-5)]
    assert load_file(str(training_state / "optimizer_state.safetensors"))  # both groups' state was saved

