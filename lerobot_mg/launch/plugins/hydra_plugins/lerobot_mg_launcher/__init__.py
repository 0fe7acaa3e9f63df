"""Hydra discovers launcher plugins only under ``hydra_plugins.*`` (and instantiates nothing else as a launcher):
this package names lerobot_mg's SLURM launcher there. The implementation is lerobot_mg.launch.submitit_launcher."""

from hydra.core.config_store import ConfigStore

from lerobot_mg.launch.submitit_launcher import SlurmLauncherConf, SlurmSweepLauncher


class LerobotSlurmLauncher(SlurmSweepLauncher):
    """``hydra/launcher=slurm`` (conf/hydra/launcher/slurm.yaml)."""


# The typed schema behind conf/hydra/launcher/slurm.yaml (registered at plugin discovery, before composition).
ConfigStore.instance().store(group="hydra/launcher", name="lerobot_mg_slurm", node=SlurmLauncherConf,
                             provider="lerobot_mg")
