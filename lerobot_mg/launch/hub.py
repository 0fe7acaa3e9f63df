"""``policy.repo_id``: the end of training publishes the final ``pretrained_model/`` with a model card.

The main process alone, after the last checkpoint is complete on disk and ``last`` names it (and after the
evaluation, whose result goes into the card). The card (``README.md`` in ``pretrained_model/``) says what was
trained: the policy, the dataset, the steps, the effective batch, the topology, the final loss and the evaluation if
any. A ``checkpoint.format=dcp`` checkpoint is merged into its safetensors weights first (the converter's merge; the
shards stay). The upload itself is :func:`lerobot_mg.checkpoint.hub.push_pretrained`, the converter's: a failure
keeps the checkpoint and raises the error naming it and the command that uploads it later.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lerobot_mg.checkpoint import layout as L
from lerobot_mg.checkpoint.convert import convert_checkpoint, merged_file_name
from lerobot_mg.checkpoint.hub import MODEL_CARD, push_pretrained
from lerobot_mg.config.schema import TrainConfig
from lerobot_mg.run_facts import Progress, RunFacts


def _describe_dataset(dataset: dict[str, Any]) -> str:
    """A dataset by its repo id, or a local one by its folder only (the card is published, the path is this
    machine's), with the commit its files came from."""
    name = dataset.get("repo_id") or Path(dataset.get("root") or "").name
    commit = dataset.get("commit")
    return name + (f" (commit {commit})" if commit
                   else f" (revision {dataset['revision']}, commit unknown)" if dataset.get("revision") else "")


def model_card(cfg: TrainConfig, facts: RunFacts, progress: Progress, final_loss: float | None,
               evaluation: dict[str, Any] | None) -> str:
    """The README.md of the published model repo."""
    # One dataset, or each source of a mixture (dataset=mixture), as the run recorded it.
    datasets = facts.mixture or [{"root": str(cfg.dataset.root), **(facts.dataset_source or {})}]
    described = "; ".join(_describe_dataset(d) + (f", weight {100 * d['weight']:.3g} %" if facts.mixture else "")
                          for d in datasets)
    repo_ids = [d["repo_id"] for d in datasets if d.get("repo_id")]
    tags = ["lerobot", "lerobot_mg", "robotics", cfg.policy.type]
    front = "\n".join(["---", "library_name: lerobot", "pipeline_tag: robotics", "tags:",
                       *(f"- {tag}" for tag in tags),
                       *(["datasets:", *(f"- {repo_id}" for repo_id in repo_ids)] if repo_ids else []), "---"])
    rows = [
        ("policy", f"{cfg.policy.type} ({facts.model['total_params']:,} parameters, "
                   f"{facts.model['trainable_params']:,} trainable)"),
        ("dataset", described),
        ("steps", f"{progress.step} loop steps, {progress.optimizer_updates} optimizer updates, "
                  f"{progress.samples_seen:,} samples"),
        ("effective batch", facts.batch.describe()),
        ("topology", f"{facts.topology.describe()} (world size {facts.topology.world_size})"),
        ("precision", facts.precision),
        ("final loss", "n/a" if final_loss is None else f"{final_loss:.6g}"),
    ]
    if facts.model.get("base_model_path"):
        rows.append(("base model", str(facts.model["base_model_path"])))
    if evaluation:
        shown = {key: value for key, value in evaluation.items() if isinstance(value, int | float | str)}
        rows.append(("evaluation", ", ".join(f"{key}={value}" for key, value in shown.items())))
    table = "\n".join(["| | |", "|---|---|", *(f"| {name} | {value} |" for name, value in rows)])
    return (f"{front}\n\n# {cfg.policy.repo_id}\n\nA {cfg.policy.type} policy trained with lerobot_mg "
            f"(job {cfg.job_name}). The files are LeRobot's `pretrained_model/` layout: config.json, the weights "
            f"and the processors, with train_config.json for the full training config.\n\n{table}\n")


def publish_policy(cfg: TrainConfig, output_dir: Path, facts: RunFacts, progress: Progress,
                   final_loss: float | None, evaluation: dict[str, Any] | None) -> str:
    """Write the card into the last checkpoint's ``pretrained_model/`` and upload it; returns the commit URL.
    Main process only, after the last checkpoint is on disk."""
    step_dir = (L.checkpoints_root(output_dir) / L.LAST_LINK).resolve()
    pretrained = step_dir / L.PRETRAINED_MODEL_DIR
    if not (pretrained / merged_file_name(pretrained)).is_file():  # checkpoint.format=dcp: shards only
        convert_checkpoint(step_dir)
    (pretrained / MODEL_CARD).write_text(model_card(cfg, facts, progress, final_loss, evaluation))
    url = push_pretrained(pretrained, str(cfg.policy.repo_id),
                          f"Upload {cfg.job_name} at step {progress.step} (lerobot_mg)")
    print(f"Published {pretrained} to {url}", flush=True)
    return url
