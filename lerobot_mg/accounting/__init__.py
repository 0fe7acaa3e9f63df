"""The run ledger and honest run comparison (seeds/comparing-runs.md)."""

from lerobot_mg.accounting.compare import Comparison, ResumeCheck, check_resume, compare_runs
from lerobot_mg.accounting.ledger import (
    LEDGER_FILENAME,
    BatchArithmetic,
    RunLedger,
    RunRecord,
    read_ledger,
    sample_digest,
)
from lerobot_mg.accounting.revision import code_revision

__all__ = [
    "LEDGER_FILENAME",
    "BatchArithmetic",
    "Comparison",
    "ResumeCheck",
    "RunLedger",
    "RunRecord",
    "check_resume",
    "code_revision",
    "compare_runs",
    "read_ledger",
    "sample_digest",
]
