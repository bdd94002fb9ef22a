"""Where an object's replicas go: distinct clients first, then distinct
segments of one client, a preferred segment first when it fits.

Among the segments that fit, each replica is placed by the power of two
choices: two candidates drawn at random, the one less full (after this
object) wins. That weighs free space, so an emptier segment fills faster,
but an empty segment that just joined (a restarted node) wins only the
draws it is part of, about 2/n of them, instead of every write (Mooncake
#3688: a restarted empty node drew every new write and became the hot spot).
"""
from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol

__all__ = ["Placeable", "place"]


class Placeable(Protocol):
    id: int
    client: str

    def fits(self, size: int) -> bool: ...

    def fill_after(self, size: int) -> float: ...


def place(segments: Sequence[Placeable], size: int, replica_num: int, *,
          preferred: int | Sequence[int] | None = None, rng: random.Random | None = None) -> list[Placeable]:
    """Up to `replica_num` distinct segments that can each hold `size`
    bytes; fewer (possibly none) when fewer fit. The `preferred` segment
    ids (one, or several in order) that fit come first; the other replicas
    land on distinct clients while there are clients left, then on
    distinct segments."""
    rng = rng or random
    fitting = [s for s in segments if s.fits(size)]
    if replica_num == 1 and preferred is None and len(fitting) <= 2:
        # the common case, without the bookkeeping below
        if len(fitting) < 2:
            return fitting
        a, b = fitting
        fa, fb = a.fill_after(size), b.fill_after(size)
        return [a if fa < fb else b if fb < fa else rng.choice((a, b))]
    chosen: list[Placeable] = []
    if preferred is not None:
        for pid in [preferred] if isinstance(preferred, int) else preferred:
            for s in fitting:
                if s.id == pid and s not in chosen and len(chosen) < replica_num:
                    chosen.append(s)
                    break
    while len(chosen) < replica_num:
        used_segments = {s.id for s in chosen}
        used_clients = {s.client for s in chosen}
        left = [s for s in fitting if s.id not in used_segments]
        if not left:
            break
        spread = [s for s in left if s.client not in used_clients]
        pool = spread or left
        if len(pool) == 1:
            pick = pool[0]
        else:
            a, b = rng.sample(pool, 2)
            fa, fb = a.fill_after(size), b.fill_after(size)
            pick = a if fa < fb else b if fb < fa else rng.choice((a, b))
        chosen.append(pick)
    return chosen
