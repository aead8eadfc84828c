"""Which rank writes which document of a distributed run: shares, claims, work stealing.

Every rank cuts the plan's documents into the same contiguous shares
(:func:`shares`), works through its own, then takes the other ranks'
unclaimed documents from the slowest share's end (:func:`steal_from`). Whoever
creates ``OUT_DIR/ranks/<run_id>/claims/<id>`` first (``O_CREAT | O_EXCL``:
it succeeds for exactly one rank, on a local disk, on NFSv3/v4 and on SMB)
writes that document; nothing here relies on locks (``flock``/``fcntl`` over
NFS and SMB vary) or on appends from two machines to one file. The folder's
file names are :mod:`mlx_tier.outdir.layout`'s.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path


class Claims:
    """Exclusive claims on documents for one distributed run: whoever creates
    ``claims/<id>`` first (``O_CREAT | O_EXCL``) writes that document, nobody else.

    Args:
        folder: the run's ``claims`` folder (created if missing).
        rank: this rank, written into each claim with the host and pid.

    Attributes:
        taken: ids this rank claimed, in order.
    """

    def __init__(self, folder: Path, rank: int) -> None:
        self.folder, self.rank = Path(folder), rank
        self.folder.mkdir(parents=True, exist_ok=True)
        self.taken: list[str] = []
        self._stamp = {"rank": rank, "host": socket.gethostname(), "pid": os.getpid()}

    def claim(self, doc_id: str) -> bool:
        """Take ``doc_id`` for this rank; ``False`` when another rank (or this one) has it.

        Raises:
            OSError: the folder is not writable (other than the claim existing).
        """
        try:
            fd = os.open(self.folder / doc_id, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0),
                         0o666)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps({**self._stamp, "time": round(time.time(), 3)}) + "\n")
        self.taken.append(doc_id)
        return True

    def claimed(self) -> set[str]:
        """Every id claimed so far by any rank (one directory listing)."""
        return set(os.listdir(self.folder))


def shares(todo: list[str], ranks: int) -> list[list[str]]:
    """``todo`` cut into ``ranks`` contiguous, disjoint shares of sizes differing by at most one
    (rank k: ``todo[k*n//ranks : (k+1)*n//ranks]``): the same on every rank, from the plan alone."""
    n = len(todo)
    return [todo[k * n // ranks:(k + 1) * n // ranks] for k in range(ranks)]


def steal_from(todo: list[str], rank: int, ranks: int, claimed: set[str]) -> list[str]:
    """What a rank done with its own share takes next: the unclaimed documents of the other
    rank with the most of them left (the slowest), from the end of its share (where its owner
    arrives last), so owner and thief work towards each other. Started ranks first (a share
    whose first document is claimed: owners start there, thieves never do), so that a rank
    still loading its model keeps its share while others have work; once no started share
    has anything left, unstarted shares are taken too, from their end, so that a rank that
    died before claiming anything does not leave its share to the next run (an owner that
    starts late still begins at the front and meets the thief). ``[]``: nothing left."""
    others = [s for k, s in enumerate(shares(todo, ranks)) if k != rank and s]
    for pool in ([s for s in others if s[0] in claimed], [s for s in others if s[0] not in claimed]):
        slowest = max(([i for i in s if i not in claimed] for s in pool), key=len, default=[])
        if slowest:
            return slowest[::-1]
    return []


def rank_order(todo: list[str], rank: int, ranks: int,
               claimed: Callable[[], set[str]]) -> Callable[[list[str]], Iterator[str]]:
    """The order in which rank ``rank`` tries the plan's documents (a
    :class:`~mlx_tier.job.run.Share`'s ``order``): its own share first, then, while
    any is left, the other ranks' unclaimed documents by :func:`steal_from`
    (the slowest started share's, from its end; ``claimed()`` lists every rank's
    claims, read again each time a stolen batch is used up; then unstarted
    shares). The runner pulls one id at a time, when the scheduler has room, and
    claims it then: a document another rank claimed first is skipped there. When
    nothing is left to take the order ends.

    Args:
        todo: the plan's documents to do, in order (the same on every rank).
        rank, ranks: this rank and how many there are.
        claimed: every id claimed so far in this run (:meth:`Claims.claimed`).
    """
    def order(pending: list[str]) -> Iterator[str]:
        here = set(pending)
        yield from (i for i in shares(todo, ranks)[rank] if i in here)
        tried = set(todo) - here  # done meanwhile (not pending here): never tried
        while batch := steal_from(todo, rank, ranks, claimed() | tried):
            for i in batch:
                tried.add(i)
                yield i

    return order
