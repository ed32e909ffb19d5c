"""Storage tiers: where checkpoint bytes live."""

from tiercheck.tiers.base import Tier
from tiercheck.tiers.local import LocalTier

__all__ = ["LocalTier", "Tier"]
