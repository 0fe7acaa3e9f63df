"""Compare training runs honestly: sample presentations, optimizer updates, what was held fixed, resumes.

    python scripts/compare_runs.py outputs/train/run_a outputs/train/run_b
    python scripts/compare_runs.py outputs/train/resumed outputs/train/reference --check-resume
    lerobot-mg-compare outputs/train/run_a outputs/train/run_b --json --out outputs/compare/a_vs_b

Reads only each run's ledger.jsonl; writes learning_curves.png and report.md to --out.
Exit status: 0, or 1 when --check-resume cannot confirm a sample-exact stream, 2 on a user error.
"""

from lerobot_mg.accounting.report import main

if __name__ == "__main__":
    raise SystemExit(main())
