"""Storage tiers: where checkpoint bytes live."""

from .base import Tier
from .local import LocalTier

__all__ = ["LocalTier", "Tier"]
