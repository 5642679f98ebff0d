"""fp8-parity's evaluation data and scorers (not installed: run from a checkout's root; evals/README.md)."""
