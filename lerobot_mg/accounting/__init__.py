"""What each run trained on and under which conditions, so that two runs can be compared honestly
(docs/comparing-runs.md): the run ledger (``ledger``), the comparison of runs (``compare``) and its report
(``report``); the facts of every start live in ``lerobot_mg.run_facts``."""
