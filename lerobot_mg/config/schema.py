"""Typed schemas of every config group, registered in Hydra's ConfigStore.

Hydra merges the YAML presets under ``conf/`` into these dataclasses, so an unknown key or a value of the
wrong type fails at compose time. Semantic checks (ranges, combinations, the world size) live in
:mod:`lerobot_mg.config.validate` and run before any process group exists.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from lerobot_mg.config.act import ACTConfig
from lerobot_mg.config.choices import (
    BestMetric,
    CheckpointFormat,
    DatasetName,
    MixedPrecision,
    MixtureStats,
    TorchDtype,
    WandbMode,
)
from lerobot_mg.config.diffusion import DiffusionConfig
from lerobot_mg.config.pi0 import PI0Config
from lerobot_mg.config.pi05 import PI05Config
from lerobot_mg.config.policy import PolicyConfig
from lerobot_mg.config.recipe import (
    OptimizerConfig,
    RecipeRecord,
    SchedulerConfig,
    describe_recipe,
    resolve_recipe,
)
from lerobot_mg.config.smolvla import SmolVLAConfig
from lerobot_mg.errors import config_error

# The top-level folder of the checkout this package runs from (conf/, outputs/bench); an installed wheel has none.
REPO_ROOT = Path(__file__).resolve().parents[2]
# The datasets shipped inside the package (package data), in a checkout and an installed wheel alike.
DATA_DIR = Path(__file__).resolve().parents[1] / "data"

# The config dataclass of each policy: the schema of its `policy` preset; lerobot_mg.policies.registry maps the same
# names to the policy classes.
POLICY_CONFIGS: dict[str, type[PolicyConfig]] = {
    "act": ACTConfig, "diffusion": DiffusionConfig, "pi0": PI0Config, "pi05": PI05Config, "smolvla": SmolVLAConfig,
}


def policy_config_class(name: str) -> type[PolicyConfig]:
    if name not in POLICY_CONFIGS:
        raise config_error("policy.type", name, "is not a known policy", f"policy=<one of {', '.join(POLICY_CONFIGS)}>")
    return POLICY_CONFIGS[name]


@dataclass
class ParallelismConfig:
    """Data-parallel layout. The default (``dp_shard`` unset) is DDP over every process the launcher started.

    Typing ``dp_shard`` asks for sharding: ``dp_shard=N`` shards parameters, gradients and optimizer state over N
    ranks (FSDP2; ``-1`` = all processes, divided by ``dp_replicate``); ``dp_replicate=R dp_shard=S`` is HSDP
    (R x S = world size). On one process started by a launcher (``torchrun --nproc-per-node=1``) a typed
    ``dp_shard`` (1 or -1) is FSDP2 on a 1-rank mesh; a shard degree of 1 on several processes is DDP. Plain
    ``python`` is one process without a process group, whatever these say.
    """

    dp_replicate: int = 1
    dp_shard: int | None = None


@dataclass
class GradientAccumulationConfig:
    steps: int = 1


@dataclass
class MixedPrecisionPolicyConfig:
    """Fields of torch's ``MixedPrecisionPolicy`` applied to every FSDP unit. Once any is set, the policy is
    built from these fields alone and replaces the one derived from ``accelerator.mixed_precision``, so set
    ``param_dtype`` too. An unset ``reduce_dtype`` follows ``param_dtype`` on the installed torch 2.13 (gradients
    are reduce-scattered in bfloat16 under ``param_dtype=bfloat16``; tests/dist/test_fsdp_options.py pins it);
    from torch 2.15 it follows the parameters' own dtype. ``float16`` needs ``accelerator.mixed_precision=fp16``,
    which builds the loss scaler."""

    param_dtype: TorchDtype | None = None
    reduce_dtype: TorchDtype | None = None
    output_dtype: TorchDtype | None = None
    cast_forward_inputs: bool | None = None

    def is_set(self) -> bool:
        return any(
            v is not None for v in (self.param_dtype, self.reduce_dtype, self.output_dtype, self.cast_forward_inputs)
        )


@dataclass
class FSDPConfig:
    """Sharding settings; only valid on sharded runs (``parallelism.dp_shard`` typed, under a launcher)."""

    wrap_modules: list[str] | None = None  # class names of the wrap units; overrides the policy's declaration
    min_num_params: int | None = None  # or: wrap every non-container submodule above this many parameters
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    # Regex matched against whole module paths, kept unsharded. Under PEFT the paths begin with `base_model.model.`:
    # begin the pattern with `.*`.
    ignored_modules: str | None = None
    mixed_precision_policy: MixedPrecisionPolicyConfig = field(default_factory=MixedPrecisionPolicyConfig)


@dataclass
class AcceleratorConfig:
    mixed_precision: MixedPrecision = MixedPrecision.no
    gradient_accumulation: GradientAccumulationConfig = field(default_factory=GradientAccumulationConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    cpu: bool = False  # train on the CPU even when a GPU is visible
    # How long a collective waits for the slowest rank before the run fails (torch's default: 30 min on gloo, 10 on
    # NCCL), on every process group of the run (the device mesh's replicate and shard groups too). It bounds a hung
    # rank; a dead one is noticed sooner (peers' connections drop, and srun --kill-on-bad-exit / torchrun stop the
    # other ranks). Above the longest legitimate wait: rank 0 writing the gathered checkpoint while the others wait
    # at the barrier.
    process_group_timeout_s: int = 600
    # Recompute in backward the activations of the policy's declared blocks (_checkpoint_modules), else of its
    # outermost wrap units, instead of keeping them; applied before sharding (FSDP2, HSDP, DDP, one process). A
    # policy that declares neither needs accelerator.fsdp.min_num_params or wrap_modules, also unsharded.
    activation_checkpointing: bool = False
    # torch.compile each outermost wrap unit (the policy's top-level modules where it has none), before sharding.
    compile: bool = False


@dataclass
class CheckpointConfig:
    format: CheckpointFormat = CheckpointFormat.safetensors  # dcp, safetensors_dcp: sharded runs only
    save_freq: int = 1000  # loop steps between checkpoints; the last step is always saved
    save_checkpoint: bool = True
    keep_last: int | None = None  # prune older checkpoints, never the one `last` names
    # Stage model + optimizer in host memory (one extra copy) and write them in a background thread while
    # training continues; `last` moves once the write finished. Every format.
    async_save: bool = False
    # Also keep the K checkpoints with the best evaluation (by best_metric), and point a `best` link at the best
    # one; with keep_best every evaluation step saves a checkpoint. null: no ranking.
    keep_best: int | None = None
    # success_rate (in simulation, higher is better) or val_loss (on dataset.val_episodes, lower is better);
    # null: success_rate where eval.n_episodes > 0, else val_loss.
    best_metric: BestMetric | None = None

    def is_save_step(self, step: int, steps: int, preempted: bool, evaluated: bool = False) -> bool:
        """Every ``save_freq`` loop steps, at the last one, on preemption and, with ``keep_best``, at every step that
        was ``evaluated`` (all on optimizer-update boundaries)."""
        return self.save_checkpoint and (preempted or step % self.save_freq == 0 or step == steps
                                         or (evaluated and self.keep_best is not None))


@dataclass
class SourceConfig:
    """One dataset of a mixture (``dataset=mixture``, ``dataset.sources``): a LeRobot v3.0 dataset found as
    ``dataset.repo_id``/``dataset.root`` are (``repo_id`` from LeRobot's cache or the Hub at ``revision``; ``root``: a
    directory), drawn with probability ``weight`` (null: its share of the mixture's frames; weights are normalised
    to sum to 1), restricted to ``episodes`` (null: all), its feature names mapped to the policy's by ``rename_map``
    (LeRobot's spelling: ``{observation.image: observation.images.top}``)."""

    root: str | None = None
    repo_id: str | None = None
    revision: str | None = None
    weight: float | None = None
    episodes: list[int] | None = None
    rename_map: dict[str, str] = field(default_factory=dict)


@dataclass
class DatasetConfig:
    """The dataset to train on: the embedded ALOHA transfer-cube demonstrations (conf/dataset/embedded.yaml, the
    default, names their cache directory), a LeRobot dataset on the Hugging Face Hub (``dataset.repo_id=<user>/<name>``,
    as LeRobot resolves it: ``dataset.root`` when typed, else ``$HF_LEROBOT_HOME/<repo_id>``, LeRobot's own cache,
    ``~/.cache/huggingface/lerobot/<repo_id>`` by default, else downloaded there once per node at ``revision``), or
    ``dataset=lerobot dataset.root=<dir>``: any LeRobot v3.0 directory. ``dataset=lerobot`` with neither a root nor a
    repo id refuses to start rather than read the embedded demos."""

    name: DatasetName = DatasetName.embedded
    root: str | None = None
    repo_id: str | None = None  # <user>/<dataset> on the Hub; the default preset's root then gives way to it
    revision: str | None = None  # a branch, tag or commit of the dataset repo; null: its default branch
    episodes: list[int] | None = None
    # LeRobot's training rule: each camera is normalised with ImageNet's mean/std instead of the dataset's (what
    # pretrained vision backbones expect; LeRobot applies it to every backbone, and so do its checkpoints' files).
    use_imagenet_stats: bool = True
    # Fine-tuning a base (policy.path) normalises with THIS dataset's statistics, as LeRobot's lerobot-train does:
    # the base's processors are loaded and their normaliser statistics replaced (use_imagenet_stats applies too).
    # true: keep the statistics saved with the base (its normaliser exactly as it was trained), e.g. to fine-tune on
    # more data of the same robot and setup. A resume always keeps its own checkpoint's.
    use_base_stats: bool = False
    # Held-out episodes, never trained on; their loss is evaluated every eval.freq steps (lerobot_mg.data.split):
    # a list of episode indices, or a count N (the dataset's last N episodes). null: no validation split.
    val_episodes: Any = None
    # dataset=mixture: the datasets drawn from, each with its weight (see SourceConfig and docs/data.md), and how
    # their samples are normalised: merged (one set of statistics, LeRobot's aggregate_stats) or per_source.
    sources: list[SourceConfig] | None = None
    stats: MixtureStats = MixtureStats.merged

    def from_repo(self, root_typed: bool) -> DatasetConfig:
        """This group with ``repo_id`` in charge: a root the user did not type (the embedded preset's cache
        directory) gives way to the repo's. A root typed on the command line, or set with ``dataset=lerobot``,
        is read as given, as LeRobot reads ``--dataset.root``. With ``dataset=mixture`` the sources are in charge: a
        root the user did not type (an experiment preset's) gives way to them."""
        if self.name == DatasetName.mixture and not root_typed:
            return replace(self, root=None)  # a preset's root (experiment=...) gives way to the sources
        if self.repo_id is None or root_typed or self.name != DatasetName.embedded:
            return self
        return replace(self, name=DatasetName.lerobot, root=None)


@dataclass
class PeftConfig:
    """Parameter-efficient fine-tuning of the base at ``policy.path`` with the ``peft`` library.

    ``method_type=null`` trains every parameter. ``LORA`` freezes the base and trains low-rank adapters on
    ``target_modules`` (null: the policy's own default, e.g. ACT's feed-forward projections) plus full copies of
    ``full_training_modules``. The adapter's output is scaled by ``lora_alpha / r``; ``lora_alpha=null`` means
    ``lora_alpha = r`` (scale 1), and the value actually used is written to adapter_config.json: the adapter is
    never rescaled behind your back by a library default (peft's own default alpha is 8 whatever ``r``).
    """

    method_type: str | None = None  # null | LORA (peft/lora.py checks it)
    r: int = 16
    lora_alpha: float | None = None  # null: = r (scale 1)
    dropout: float = 0.0  # on the adapter's input
    target_modules: list[str] | None = None  # module names (or name suffixes); null: the policy's default
    full_training_modules: list[str] | None = None  # modules trained in full (a copy; the base stays frozen)

    @property
    def enabled(self) -> bool:
        return self.method_type is not None

    def alpha(self) -> float:
        return float(self.r if self.lora_alpha is None else self.lora_alpha)


@dataclass
class EMAConfig:
    """An exponential moving average of the trained weights (lerobot_mg/ema.py), with Diffusion Policy's warm-up
    schedule and defaults: after n optimizer updates the decay is ``1 - (1 + k / inv_gamma) ** -power`` with
    ``k = n - update_after_step - 1``, clamped to ``[min_decay, max_decay]``, and 0 (a copy of the weights) until
    k > 0. Each checkpoint holds the averaged weights as ``pretrained_model_ema/`` beside ``pretrained_model/``."""

    enable: bool = False
    power: float = 0.75
    inv_gamma: float = 1.0
    min_decay: float = 0.0
    max_decay: float = 0.9999
    update_after_step: int = 0  # optimizer updates before the average starts to lag the weights
    # Evaluation in simulation (eval.*) rolls out the averaged weights when the checkpoint has them.
    use_for_eval: bool = True


@dataclass
class WandbConfig:
    mode: WandbMode = WandbMode.offline
    project: str = "lerobot_mg"
    entity: str | None = None
    group: str | None = None  # runs of one group show together; a sweep sets it to the sweep's name


@dataclass
class LoggingConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    # Progress on stdout (main process): a bar on a terminal; otherwise (a SLURM .out file, `> log`) one plain line
    # every log_every_s seconds and at every log step. false: neither.
    progress_bar: bool = True
    log_every_s: float = 30.0
    record_sample_digests: bool = True  # a digest of the index values the DataLoaders delivered, per optimizer update


@dataclass
class TrackioConfig:
    """trackio, the local-first tracker (the `trackio` extra): the same metrics as wandb at the same steps, into a
    local store (``$TRACKIO_DIR``, default ``~/.cache/huggingface/trackio``; ``trackio show`` opens it)."""

    enable: bool = False
    project: str = "lerobot_mg"
    group: str | None = None  # runs of one group show together; a sweep sets it to the sweep's name


@dataclass
class EvalConfig:
    """Evaluation during training, every ``freq`` loop steps and at the last one, on every rank of every layout:
    ``n_episodes`` rollouts in the ALOHA transfer-cube simulation (the `sim` extra), spread over the ranks, and the
    loss on ``dataset.val_episodes``, split over the ranks (lerobot_mg.evaluation)."""

    freq: int = 0  # loop steps between evaluations (a multiple of the accumulation steps); 0: the last step only
    n_episodes: int = 0
    seed_start: int = 100_000  # held-out seeds, disjoint from the embedded dataset's
    n_video_episodes: int = 0  # mp4s of the first episodes of each evaluation, under <run>/eval/<step>/videos
    max_steps: int | None = None  # steps per rollout; null: the task's episode length (400)
    val_batches: int | None = None  # batches of the validation loss; null: all of dataset.val_episodes
    val_batch_size: int | None = None  # samples per validation batch; null: batch_size


@dataclass
class TrainConfig:
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    accelerator: AcceleratorConfig = field(default_factory=AcceleratorConfig)
    # The config dataclass of the chosen policy (ACTConfig, DiffusionConfig, ...): the `policy` group's schema is
    # the one registered for that preset (register_configs), so its keys are typed like every other group's.
    policy: Any = MISSING
    peft: PeftConfig = field(default_factory=PeftConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    # LeRobot's switch, true as in LeRobot: the optimizer.* / scheduler.* keys the config leaves unset come from
    # the policy's training preset (ACT: AdamW at 1e-5 with its backbone group; Diffusion: Adam, betas
    # (0.95, 0.999), 500 warm-up steps; ...). A key the config sets wins (LeRobot would ignore it). false: the unset
    # keys take lerobot_mg's defaults (AdamW at 1e-4, cosine with 100 warm-up steps). docs/training-recipe.md.
    use_policy_training_preset: bool = True
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # Written when the config is resolved (below), kept by a resume: which policy's preset gave which keys.
    training_recipe: RecipeRecord | None = None
    ema: EMAConfig = field(default_factory=EMAConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    trackio: TrackioConfig = field(default_factory=TrackioConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    output_dir: str | None = None  # default: outputs/train/<date>/<time>_<job_name>_<id>, one per run
    job_name: str = "${policy.type}"
    seed: int = 1000
    steps: int = 2000  # loop steps (micro-batches per worker), not optimizer updates
    batch_size: int = 8  # per data-parallel worker
    num_workers: int = 0  # DataLoader worker processes per rank
    torch_threads: int | None = None  # intra-op threads per process (torch.set_num_threads); None: torch's default
    log_freq: int = 100
    resume: bool = False
    config_path: str | None = None  # train_config.json of the checkpoint to resume
    # Print the memory plan of the composed layout (per-rank bytes by component, wrap units, effective batch) and
    # exit 0, before any process group exists; nothing is trained or written.
    plan: bool = False
    # With plan=true: plan the layout of a job of this many ranks from one process (e.g. on a login node), instead
    # of the world the launcher started.
    plan_world_size: int | None = None
    # With plan=true: the memory of one rank's device, in GiB, to check the plan's fit against (None: this
    # machine's GPU, or its host RAM for a CPU run).
    plan_device_memory_gib: float | None = None

    def __post_init__(self) -> None:
        """Every typed run config holds its complete recipe: the optimizer.* / scheduler.* keys left unset are filled
        here, once, from the policy's training preset (``use_policy_training_preset``) or the defaults
        (lerobot_mg.config.recipe). A config read back from train_config.json (a resume) is complete already and
        keeps the record of its first resolution; a requeued sweep job, composed again like its first attempt,
        resolves to the same recipe."""
        policy = self.policy if isinstance(self.policy, PolicyConfig) else None
        preset = policy.training_preset() if policy is not None and self.use_policy_training_preset else None
        self.optimizer, self.scheduler, record = resolve_recipe(
            self.optimizer, self.scheduler, preset, None if policy is None else policy.type, self.steps)
        if self.training_recipe is None:
            self.training_recipe = record

    def recipe_lines(self) -> list[str]:
        """The optimizer and schedule this run trains with and where they came from, for the banner."""
        return describe_recipe(self.optimizer, self.scheduler, self.training_recipe or RecipeRecord())

    def best_metric(self) -> BestMetric:
        """The metric ``checkpoint.keep_best`` ranks by: ``checkpoint.best_metric``, else the success rate where the
        run evaluates in simulation, else the validation loss."""
        if self.checkpoint.best_metric is not None:
            return BestMetric(self.checkpoint.best_metric)
        return BestMetric.success_rate if self.eval.n_episodes > 0 else BestMetric.val_loss


def register_configs() -> None:
    # ${lerobot_mg_data:} in conf/: DATA_DIR, e.g. the PushT slice of experiment=pusht_debug.
    OmegaConf.register_new_resolver("lerobot_mg_data", lambda: str(DATA_DIR), replace=True)
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    for name, config_class in POLICY_CONFIGS.items():  # conf/policy/<name>.yaml starts from <name>_schema
        cs.store(group="policy", name=f"{name}_schema", node=config_class)
