"""The scorers: the zoo, the held-out sets, timings (run from a checkout's root: python -m evals.scoring.NAME)."""
