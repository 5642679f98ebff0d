"""The mutant zoo (mutants.py) and the faults only training shows (train_faults.py)."""
