"""Compare training runs honestly: sample presentations, optimizer updates, what was held fixed, resumes.

    python scripts/compare_runs.py outputs/train/run_a outputs/train/run_b
    python scripts/compare_runs.py outputs/train/resumed outputs/train/reference check_resume=true
    python scripts/compare_runs.py outputs/train/run_a outputs/train/run_b tolerance=0.05
    lerobot-mg-compare run_dirs=[outputs/train/run_a,outputs/train/run_b] --json=true --out=outputs/compare/a_vs_b
    lerobot-mg-compare --help                        # every key, its type and default

Reads only each run's ledger.jsonl; writes learning_curves.png and report.md to `out`. Counts are held fixed
when equal; the compute budget (measured by the clock) when within `tolerance` (relative, default 0.1).
Exit status: 0; 1 when check_resume finds the resumed stream neither sample-exact nor global-batch-exact, or
cannot verify it; 2 on a user error.
"""

from lerobot_mg.scripts_entry import compare_runs

if __name__ == "__main__":
    raise SystemExit(compare_runs())
