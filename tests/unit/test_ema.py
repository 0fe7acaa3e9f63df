"""The EMA of the weights (lerobot_mg/ema.py): Diffusion Policy's schedule and arithmetic, the one swap of the averages
into the weights that checkpoints and evaluations share, what the memory plan counts for it, and lerobot-mg-convert-dcp
on its shards. The sharded runs are in tests/dist/test_ema_runs.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch import nn

from lerobot_mg.checkpoint import layout as L
from lerobot_mg.checkpoint.convert import main as convert_main
from lerobot_mg.checkpoint.ema_files import ema_model_state
from lerobot_mg.config.schema import EMAConfig
from lerobot_mg.distributed.memory import param_facts, planned_rank_bytes
from lerobot_mg.distributed.parallel_dims import ParallelDims
from lerobot_mg.ema import ModelEMA, ema_decay
from lerobot_mg.evaluation import gather_full_weights
from tests.unit.test_convert import dcp_checkpoint, tiny_policy
from tests.unit.test_memory_plan import _plan, _train_config

# The shards are written without a process group on purpose; torch warns about that on every save.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class DiffusionPolicyEMA:
    """Diffusion Policy's own schedule and update (diffusion_policy/model/diffusion/ema_model.py), line for line,
    on a plain state dict: the reference."""

    def __init__(self, update_after_step: int, inv_gamma: float, power: float, min_value: float, max_value: float):
        self.update_after_step, self.inv_gamma, self.power = update_after_step, inv_gamma, power
        self.min_value, self.max_value = min_value, max_value
        self.optimization_step = 0

    def get_decay(self, optimization_step: int) -> float:
        step = max(0, optimization_step - self.update_after_step - 1)
        value = 1 - (1 + step / self.inv_gamma) ** -self.power
        if step <= 0:
            return 0.0
        return max(self.min_value, min(value, self.max_value))

    def step(self, averaged: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> None:
        decay = self.get_decay(self.optimization_step)
        for name, ema_param in averaged.items():
            ema_param.mul_(decay)
            ema_param.add_(new[name], alpha=1 - decay)
        self.optimization_step += 1


SCHEDULES = [EMAConfig(enable=True), EMAConfig(enable=True, power=2 / 3, update_after_step=3),
             EMAConfig(enable=True, inv_gamma=2.0, min_decay=0.5, max_decay=0.9)]


@pytest.mark.parametrize("cfg", SCHEDULES, ids=["defaults", "warm_start", "clamped"])
def test_the_decay_is_diffusion_policys(cfg: EMAConfig) -> None:
    reference = DiffusionPolicyEMA(cfg.update_after_step, cfg.inv_gamma, cfg.power, cfg.min_decay, cfg.max_decay)
    decays = [ema_decay(cfg, n) for n in range(2000)]
    assert decays == [reference.get_decay(n) for n in range(2000)]
    assert decays[: cfg.update_after_step + 2] == [0.0] * (cfg.update_after_step + 2)  # a copy until it warms up
    assert all(cfg.min_decay <= d <= cfg.max_decay for d in decays[cfg.update_after_step + 2:])


def test_updates_average_the_trainable_parameters_only_as_diffusion_policy_does() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    model[1].requires_grad_(False)  # frozen: not averaged
    cfg = EMAConfig(enable=True, update_after_step=1)
    ema = ModelEMA.of(cfg, model)
    assert ModelEMA.of(EMAConfig(), model) is None
    assert sorted(ema.shadow) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    reference = DiffusionPolicyEMA(cfg.update_after_step, cfg.inv_gamma, cfg.power, cfg.min_decay, cfg.max_decay)
    expected = {name: tensor.clone() for name, tensor in ema.shadow.items()}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    for _ in range(7):
        model(torch.randn(3, 4)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        ema.update()
        reference.step(expected, dict(model.named_parameters()))
    assert ema.updates == 7 and ema.decay == reference.get_decay(6)
    for name, tensor in expected.items():
        assert torch.equal(ema.shadow[name], tensor), name  # the same arithmetic, bit for bit
        assert ema.shadow[name].data_ptr() != dict(model.named_parameters())[name].data_ptr()  # its own memory
    assert not torch.equal(ema.shadow["0.weight"], model[0].weight)  # the average lags the weights
    assert sum(t.numel() * t.element_size() for t in ema) == sum(
        p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    ema.load_state({"updates": 3, "decay": 0.25})
    assert ema.state() == {"updates": 3, "decay": 0.25}
    ema.restart()
    assert ema.updates == 0 and torch.equal(ema.shadow["0.weight"], model[0].weight)


# The weights with the EMA swapped in, as each caller makes them (one process: nothing to gather).
SWAPS = {
    "evaluation": gather_full_weights,  # the in-training evaluator (ema.use_for_eval)
    "checkpoint": lambda model, ema: ema_model_state(model, ema, full=False, main=True),  # pretrained_model_ema/
    "checkpoint_gathered": lambda model, ema: ema_model_state(model, ema, full=True, main=True),  # its safetensors
}


@pytest.mark.parametrize("swap", list(SWAPS))
def test_the_averages_replace_the_trainable_weights_only(swap: str) -> None:
    """Evaluations and checkpoints get the same weights: every trainable parameter's average, the frozen parameters
    and the buffers as the model holds them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    model[1].requires_grad_(False)  # frozen: its parameters, like its buffers, stay the model's
    ema = ModelEMA.of(EMAConfig(enable=True), model)
    for average in ema:
        average.add_(1.0)  # averages that differ from the weights everywhere
    weights = SWAPS[swap](model, ema)
    assert weights.keys() == model.state_dict().keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(weights[name], ema.shadow.get(name, tensor)), name
    assert sorted(ema.shadow) == ["0.bias", "0.weight", "2.bias", "2.weight"]


@pytest.mark.parametrize("swap", list(SWAPS))
def test_an_average_the_state_dict_has_no_entry_for_is_refused(swap: str) -> None:
    """A policy compiled whole names its parameters ``_orig_mod.*`` and its state dict without the prefix: an EMA of
    those names matches no entry. Every caller refuses it; the evaluation used to skip it and roll out the trained
    weights as if they were the averages."""
    model = torch.compile(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)))  # a wrapper: nothing compiles here
    ema = ModelEMA.of(EMAConfig(enable=True), model)
    with pytest.raises(RuntimeError, match=r"the EMA holds parameters the model's state dict lacks: "
                                           r"\['_orig_mod\.0\.bias', '_orig_mod\.0\.weight'"):
        SWAPS[swap](model, ema)


def test_the_plan_counts_the_ema_of_each_rank_shard() -> None:
    """One average per trainable element, sharded like the parameters: a rank of FSDP-2 holds half a DDP rank's."""
    ddp = _plan(_train_config(["ema.enable=true"]), ParallelDims.resolve(1, 1, 2))
    fsdp = _plan(_train_config(["ema.enable=true", "parallelism.dp_shard=2"]), ParallelDims.resolve(1, 2, 2))
    off = _plan(_train_config([]), ParallelDims.resolve(1, 1, 2))
    for held in ddp.per_rank:
        assert held.ema == held.trainable_parameters > 0
        assert held.total == off.per_rank[0].total + held.ema
    assert [held.ema for held in fsdp.per_rank] == [held.trainable_parameters for held in fsdp.per_rank]
    assert abs(sum(held.ema for held in fsdp.per_rank) - ddp.per_rank[0].ema) == 0  # the shards add up
    assert max(held.ema for held in fsdp.per_rank) / ddp.per_rank[0].ema == pytest.approx(1 / 2, rel=0.02)
    lines = fsdp.describe()
    assert any(" + EMA " in line and line.startswith("  rank 1 ") for line in lines), lines
    assert not any(" + EMA " in line for line in off.describe())
    assert all(option.per_rank.ema == option.per_rank.trainable_parameters for option in fsdp.options())
    facts = param_facts(nn.Linear(3, 5), ignored_modules=None)
    assert planned_rank_bytes(facts, 4, 0, upcast_trainable=False, ema=True).ema == 2 * (3 + 1) * 4


def test_convert_dcp_writes_the_ema_safetensors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A dcp checkpoint with EMA: both pretrained_model/ and pretrained_model_ema/ get their model.safetensors."""
    policy = tiny_policy()
    step_dir = tmp_path / "000006"
    dcp_checkpoint(step_dir, policy)
    ema_dir = step_dir / L.PRETRAINED_MODEL_EMA_DIR
    policy.write_config(ema_dir)
    averaged = {name: tensor.clone() + 1.0 for name, tensor in policy.state_dict().items()}
    dcp.save(averaged, checkpoint_id=ema_dir / L.MODEL_DCP_DIR, no_dist=True)

    assert convert_main([f"checkpoint_dir={step_dir}", "delete_dcp=true"]) == 0

    out = capsys.readouterr().out
    assert f"wrote {step_dir / L.PRETRAINED_MODEL_DIR / L.MODEL_SAFETENSORS}" in out
    assert f"wrote {ema_dir / L.MODEL_SAFETENSORS}" in out
    merged = load_file(str(ema_dir / L.MODEL_SAFETENSORS))
    assert merged.keys() == averaged.keys() and all(torch.equal(merged[k], v) for k, v in averaged.items())
    assert not (ema_dir / L.MODEL_DCP_DIR).exists()  # verified, then deleted like the weights' shards


def test_evaluation_takes_the_ema_weights_when_the_checkpoint_has_them(tmp_path: Path) -> None:
    pretrained = tmp_path / "000006" / L.PRETRAINED_MODEL_DIR
    pretrained.mkdir(parents=True)
    assert L.weights_dir(pretrained, use_ema=True) == pretrained  # no EMA saved: the weights
    (pretrained.parent / L.PRETRAINED_MODEL_EMA_DIR).mkdir()
    assert L.weights_dir(pretrained, use_ema=True) == pretrained.parent / L.PRETRAINED_MODEL_EMA_DIR
    assert L.weights_dir(pretrained, use_ema=False) == pretrained


def test_lerobot_mg_eval_rolls_out_the_ema_weights_unless_told(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """The command picks pretrained_model_ema/ beside policy_path (use_ema=true, the default) and says so."""
    pytest.importorskip("mujoco", reason="lerobot-mg-eval needs the sim extra")
    from lerobot_mg.sim import cli as sim_cli

    rolled_out: list[Path] = []

    def fake_evaluate(weights: Path, *args: object, **kwargs: object) -> dict:
        rolled_out.append(Path(weights))
        return {"num_successes": 0, "n_episodes": 1, "success_rate": 0.0, "mean_return": 0.0,
                "seconds_per_episode": 0.0, "videos": []}

    monkeypatch.setattr(sim_cli, "evaluate_policy", fake_evaluate)
    pretrained = tmp_path / "000006" / L.PRETRAINED_MODEL_DIR
    (pretrained.parent / L.PRETRAINED_MODEL_EMA_DIR).mkdir(parents=True)
    pretrained.mkdir()
    assert sim_cli.eval_main([f"policy_path={pretrained}", "n_episodes=1"]) == 0
    assert sim_cli.eval_main([f"policy_path={pretrained}", "n_episodes=1", "use_ema=false"]) == 0
    assert rolled_out == [pretrained.parent / L.PRETRAINED_MODEL_EMA_DIR, pretrained]
    assert f"evaluating {pretrained.parent / L.PRETRAINED_MODEL_EMA_DIR}" in capsys.readouterr().out
