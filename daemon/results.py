"""What the store's requests answer, typed (the service layer turns them into replies)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvtier.tiers.vocab import Tier


class GrantStatus(enum.Enum):
    """Allocate's answer for one key."""

    GRANTED = enum.auto()   # write the payload at the offset, then commit the grant
    PRESENT = enum.auto()   # already held (in host or on disk): nothing to write
    NO_SPACE = enum.auto()  # every slot is pinned or granted: retry later


@dataclass(frozen=True)
class GrantResult:
    status: GrantStatus
    grant_id: int = 0
    offset: int = 0
    durable: bool = False   # PRESENT and on disk (reported for durable puts only)

    @property
    def granted(self) -> bool:
        return self.status is GrantStatus.GRANTED


@dataclass(frozen=True)
class CommitResult:
    committed: int   # made visible now
    durable: int     # of the committed grants' keys, how many are on disk and indexed (durable commits)


@dataclass(frozen=True)
class LeaseResult:
    """Acquire's answer for one key: a pinned slot to read until released, or a miss."""

    lease_id: int = 0             # 0: a miss
    offset: int = 0
    found_in: Tier | None = None  # host, or disk for a block promoted to host to serve it

    @property
    def hit(self) -> bool:
        return self.lease_id != 0


MISS = LeaseResult()
NO_SPACE = GrantResult(GrantStatus.NO_SPACE)
