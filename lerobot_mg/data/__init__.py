"""LeRobot v3.0 datasets (reader, writer, video codec) and the resumable data-parallel batch sampler.

The writer (``lerobot_mg.data.writer``, which needs pandas) is imported from its module: training reads datasets
and never imports it.
"""

from lerobot_mg.data.lerobot_dataset import LeRobotDataset
from lerobot_mg.data.sampler import ResumableBatchSampler

__all__ = ["LeRobotDataset", "ResumableBatchSampler"]
