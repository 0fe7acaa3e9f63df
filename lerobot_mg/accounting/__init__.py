"""What each run trained on and under which conditions (docs/comparing-runs.md): the facts of every start
(``facts``), the run ledger (``ledger``), the comparison of runs (``compare``) and its report and CLI (``report``)."""
