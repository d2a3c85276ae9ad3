"""pipprune: auditable PIP (Perturbation-based Iterative Pruning) pipeline."""

__version__ = "0.1.0"
