"""pipprune: auditable PIP (Perturbation-based Iterative Pruning) pipeline. The CLI lives here."""

from infra.version import __version__

__all__ = ["__version__"]
