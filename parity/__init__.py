"""parity: the FP8 parity engine (cases, implementations, oracles, metrics, policies, reports)."""

__version__ = "0.1.0"
