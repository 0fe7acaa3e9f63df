"""A run's evaluations (the ledger's eval records), for ``lerobot-mg-compare``: its best success rate in simulation
and its lowest validation loss, each with the loop step, samples and optimizer updates of the weights it evaluated.
"""

from __future__ import annotations

from dataclasses import dataclass

from lerobot_mg.accounting.ledger import EvalRecord, RunRecord


@dataclass(frozen=True)
class RunEvals:
    """The evaluations of one run (the effective ones: those a later resume redid are dropped)."""

    count: int
    best_success: EvalRecord | None  # the highest success rate; ties: the earliest that reached it
    best_val_loss: EvalRecord | None  # the lowest validation loss

    def describe(self) -> list[str]:
        """One line per best evaluation, e.g. ``best success rate 0.62 (31/50) at loop step 1,500 (12,000
        samples, 1,500 updates)``."""
        if self.count == 0:
            return ["no evaluation recorded"]
        lines = []
        if self.best_success is not None:
            m = self.best_success.metrics
            lines.append(f"best success rate {m.success_rate:.2f} ({m.num_successes}/{m.n_episodes}) "
                         f"{_where(self.best_success)}")
        if self.best_val_loss is not None:
            m = self.best_val_loss.metrics
            lines.append(f"lowest val loss {m.val_loss:.4g} ({m.val_samples:,} samples) {_where(self.best_val_loss)}")
        return lines


def _where(record: EvalRecord) -> str:
    p = record.progress
    return f"at loop step {p.step:,} ({p.samples_seen:,} samples, {p.optimizer_updates:,} updates)"


def run_evals(record: RunRecord) -> RunEvals:
    evals = record.evals
    with_sim = [r for r in evals if r.metrics.success_rate is not None]
    with_val = [r for r in evals if r.metrics.val_loss is not None]
    # max/min keep the first of equal values: the earliest evaluation that reached the best figure.
    return RunEvals(len(evals), max(with_sim, key=lambda r: r.metrics.success_rate, default=None),
                    min(with_val, key=lambda r: r.metrics.val_loss, default=None))
