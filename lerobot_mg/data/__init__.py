"""LeRobot v3.0 datasets (reader, writer, video codec) and the resumable data-parallel batch sampler."""

from lerobot_mg.data.lerobot_dataset import LeRobotDataset
from lerobot_mg.data.sampler import ResumableBatchSampler
from lerobot_mg.data.writer import LeRobotDatasetWriter

__all__ = ["LeRobotDataset", "LeRobotDatasetWriter", "ResumableBatchSampler"]
