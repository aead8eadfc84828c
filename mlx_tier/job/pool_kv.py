"""The decode pool's KV cache: sequences join and leave it in place.

mlx-lm's ``BatchKVCache`` holds a batch's keys and values as one array per
layer, ``[B, kv heads, L, head dim]``, each sequence right-justified at the
last written column (left padding before it). A sequence joins a batch with
``extend`` and leaves with ``filter``, and both build the whole array anew:
``extend`` pads and concatenates every row, ``filter`` gathers the rows kept.
In the throughput schedule the decode pool holds many long sequences and
sequences join and leave it every few steps, so each join and each finish
copied the pool's whole KV cache, every layer (benches/kv_joins.py times
them inside the demo job; benches/results/throughput/NOTES.md).

:class:`RoomyKVCache` is ``BatchKVCache`` with spare rows (room for the
sequences the pool engine holds: those whose KV caches the scheduler
admitted) and spare columns (room for the longest of them, and
:data:`ROOM_SLACK` more): a sequence that is not longer
than the batch's last column is written into a free row where it stands; a
finish moves one row for each sequence that left (the last rows fill the
holes: :func:`in_place_pool` has mlx-lm's ``GenerationBatch`` order its
lists the same way); left padding that every row shares is dropped only once
it reaches :data:`SHIFT_COLUMNS`, or before a decode step that would find
no room after the rows (:func:`make_room`). A joining sequence longer than the batch's last column, and a drop of
the shared padding, move the live columns within the buffer, a row at a time
through a copy of the row. Only a pool that outgrows its room is copied into
a larger buffer. Fresh memory is dear: a
pool grown as its sequences come allocates its whole size again at each
growth, and on a VM each first touch of a page can cost tens of
microseconds (benches/results/throughput/NOTES.md).

Numerics: a row's padding is zeros, as in mlx-lm's cache; its columns
after the batch's last one may hold an earlier sequence's values until a
decode step writes them (nothing reads them before). Each sequence's keys,
values, offset and mask are mlx-lm's
(tests/job/test_pool_kv.py), and the pool engine's tokens equal mlx-lm's
alone (tests/job/test_pool_engine.py).
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

# Left padding every row of a pool shares, in columns, before it is dropped (a move of
# the live rows): without dropping it the columns would grow with every decode step of a
# long job; dropping it at each finish, as mlx-lm does, copies the cache each time.
SHIFT_COLUMNS = 256
# Columns of room beyond the longest sequence expected: the pool's rows end together, so a
# shorter row's left padding adds to the columns; before a decode step that would find no
# room, the shared padding (at least this much then) is dropped in place (make_room).
ROOM_SLACK = 64


class RoomyKVCache(BatchKVCache):
    """``BatchKVCache`` whose ``keys``/``values`` ``[rows, H, L, D]`` have spare rows and
    columns; the batch is the first :attr:`batch` rows and ``[0, _idx)`` columns (module doc).
    Made from a filled ``BatchKVCache`` by :func:`make_roomy`."""

    rows: int  # rows to make room for when the buffer grows (the sequences the engine holds)
    batch: int  # live rows
    longest: int = 0  # tokens of the longest sequence to make room for when the buffer grows

    def _grow(self, rows: int, columns: int, shift: int = 0) -> None:
        """Room for ``rows`` rows and ``columns`` columns, the live rows moved ``shift``
        columns to the right: in place when the buffer has the room, else in a new
        buffer of :attr:`rows` rows (or ``rows``, if more) and :attr:`longest` +
        :data:`ROOM_SLACK` columns (or ``columns`` rounded up to ``step``, if more):
        sized from the sequences held now, so it may be narrower than the old one."""
        B, H, L, D = self.keys.shape
        M = self.values.shape[3]
        if rows <= B and columns <= L:
            self._move(shift)
            return
        # Sized anew from the sequences held, not from the old buffer's shape: only the
        # live rows and columns ([:batch], [:_idx]) are copied, and ``rows``/``columns`` cover them.
        rows = max(rows, self.rows)
        room = self.longest + ROOM_SLACK if self.longest else 0
        columns = room if room >= columns else -(-columns // self.step) * self.step
        keys = mx.zeros((rows, H, columns, D), self.keys.dtype)
        values = mx.zeros((rows, H, columns, M), self.values.dtype)
        n, idx = self.batch, self._idx
        keys[:n, :, shift:shift + idx, :] = self.keys[:n, :, :idx, :]
        values[:n, :, shift:shift + idx, :] = self.values[:n, :, :idx, :]
        self.keys, self.values = keys, values
        if shift:
            self.left_padding = self.left_padding + shift
            self._idx += shift

    def _move(self, shift: int) -> None:
        """Move the live rows' columns ``shift`` to the right (``< 0``: to the left, dropping
        that much shared padding) within the buffer; columns left behind on the left are
        zeros (padding). A row at a time goes through a copy of its own (a write from a slice
        of the same buffer would copy the whole buffer; a copy of all rows at once, fresh
        memory each layer where MLX's buffer cache is smaller than it)."""
        if shift == 0:
            return
        n, idx = self.batch, self._idx
        first = max(0, -shift)  # the first column kept
        columns, to = mx.arange(first, idx), first + shift
        for r in range(n):
            k, v = (mx.take(a[r:r + 1], columns, axis=2) for a in (self.keys, self.values))
            mx.eval(k, v)
            self.keys[r:r + 1, :, to:to + idx - first, :] = k
            self.values[r:r + 1, :, to:to + idx - first, :] = v
            del k, v
            mx.eval(self.keys, self.values)
        if shift > 0:
            self.keys[:n, :, :shift, :] = 0
            self.values[:n, :, :shift, :] = 0
        self.left_padding = self.left_padding + shift
        self._idx += shift

    def make_room(self, tokens: int) -> bool:
        """Before a step writes ``tokens`` columns: with no room for them after the rows, drop
        the shared padding in place when there is :data:`ROOM_SLACK` of it (else the step
        grows the buffer). Between steps only: a step's mask is made from the cache before
        its layers write. Returns whether the rows moved."""
        if self.keys is None or not self.batch or self._idx + tokens <= self.keys.shape[2]:
            return False
        shared = min(self.left_padding.tolist())
        if shared < max(tokens, ROOM_SLACK):
            return False
        self._move(-shared)
        return True

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        n, prev = keys.shape[2], self._idx
        if prev + n > self.keys.shape[2]:
            self._grow(self.batch, prev + n)
        self.offset = self.offset + n
        self._idx += n
        self.keys[: self.batch, :, prev:self._idx, :] = keys
        self.values[: self.batch, :, prev:self._idx, :] = values
        return self.keys_and_values()

    def keys_and_values(self):
        return self.keys[: self.batch, :, : self._idx, :], self.values[: self.batch, :, : self._idx, :]

    @property
    def state(self):
        return self.keys, self.values, self.offset, self.left_padding, self._idx

    @state.setter
    def state(self, v):
        self.keys, self.values, self.offset, self.left_padding, self._idx = v
        self.batch = int(self.offset.shape[0])

    def filter(self, batch_indices) -> None:
        """Keep rows ``batch_indices`` (in that order): each row whose place changes is
        copied alone into its new place (with :func:`tail_into_holes`' order, only rows
        from beyond the new size move, one for each row that left)."""
        keep = [int(i) for i in (batch_indices.tolist() if isinstance(batch_indices, mx.array) else batch_indices)]
        moved = [(to, src) for to, src in enumerate(keep) if to != src]
        # A write into a buffer that something else still references copies all of it: so
        # each moved row is gathered into a buffer of its own (a contiguous row slice would
        # share the cache's); the graphs that read the cache are gone (in_place_pool). Only the
        # live columns: those after them are not read before a decode step writes them.
        idx = self._idx
        rows = [(mx.take(self.keys[..., :idx, :], mx.array([s]), axis=0),
                 mx.take(self.values[..., :idx, :], mx.array([s]), axis=0)) for _, s in moved]
        mx.eval(rows)
        for (to, _), (k, v) in zip(moved, rows):
            self.keys[to:to + 1, :, :idx, :] = k
            self.values[to:to + 1, :, :idx, :] = v
        index = mx.array(keep, dtype=mx.int32)
        self.offset, self.left_padding, self.batch = self.offset[index], self.left_padding[index], len(keep)
        shared = min(self.left_padding.tolist()) if keep else 0
        if shared >= SHIFT_COLUMNS:
            self._move(-shared)

    def extend(self, other: BatchKVCache) -> None:
        """Add ``other``'s rows after this batch's, right-justified at the last column:
        in place when they fit (module doc)."""
        if other.keys is None:
            raise ValueError("a sequence joins a decode pool with its prompt read (empty cache)")
        b, oi = other.keys.shape[0], other._idx
        shift = max(0, oi - self._idx)
        if shift or self.batch + b > self.keys.shape[0]:
            self._grow(self.batch + b, self._idx + shift, shift)
        left = self._idx - oi
        n = self.batch
        self.keys[n:n + b, :, left:self._idx, :] = other.keys[..., :oi, :]
        self.values[n:n + b, :, left:self._idx, :] = other.values[..., :oi, :]
        if left:  # a reused row's padding: zeros, as mlx-lm's (an earlier sequence's inf or nan, times 0, is nan)
            self.keys[n:n + b, :, :left, :] = 0
            self.values[n:n + b, :, :left, :] = 0
        self.offset = mx.concatenate([self.offset, other.offset])
        self.left_padding = mx.concatenate([self.left_padding, other.left_padding + left])
        self.batch = n + b


def tail_into_holes(keep: list[int]) -> list[int]:
    """``keep`` (rows to keep, ascending, as mlx-lm's ``GenerationBatch`` filters its
    batch) reordered so that each row beyond the new size fills the place of a row
    that left, and every other row keeps its place: ``[0, 1, 3, 4, 5]`` (row 2 left)
    becomes ``[0, 1, 5, 3, 4]``. A batch's rows are independent, so the order of its
    sequences changes nothing they compute."""
    size, kept = len(keep), set(keep)
    order = list(range(size))
    for hole, row in zip((i for i in range(size) if i not in kept), (i for i in keep if i >= size)):
        order[hole] = row
    return order


def in_place_pool(batch) -> None:
    """Let a ``GenerationBatch``'s :class:`RoomyKVCache` layers change in place as its
    sequences finish: its filter orders them as :func:`tail_into_holes` does (its lists
    and caches alike: one row moved for each sequence that left), after evaluating the
    next step that mlx-lm started ahead (its lazy graph reads the caches, and a write
    into a buffer still read copies all of it); a finished sequence's cache is not
    extracted into its response (mlx-lm copies it out, lazily, from the same buffer;
    the pool engine never reads it)."""
    filter_ = batch.filter

    def filter_in_place(keep):
        settle(batch)
        filter_(tail_into_holes([int(i) for i in keep]))

    missing = [a for a in ("_next_tokens", "_next_logprobs", "filter", "extract_cache") if not hasattr(batch, a)]
    if missing:  # a newer mlx-lm: settle() would do nothing, and the pool be copied at every finish
        raise TypeError(f"mlx-lm's GenerationBatch has no {', '.join(missing)}: pool_kv needs updating")
    batch.filter = filter_in_place
    batch.extract_cache = lambda idx: None


def settle(batch) -> None:
    """Evaluate the step a ``GenerationBatch`` started ahead (its next tokens and
    log-probabilities): until then its lazy graph reads the batch's caches, and a
    :class:`RoomyKVCache` written meanwhile would be copied whole instead of in place.
    Call before a sequence joins or leaves."""
    pending = [a for a in (getattr(batch, "_next_tokens", None), *(getattr(batch, "_next_logprobs", None) or ()))
               if a is not None]
    mx.eval(pending)


def make_room(batch, tokens: int = 1) -> None:
    """Before ``batch`` (a ``GenerationBatch``) decodes a step of ``tokens`` columns: each of
    its :class:`RoomyKVCache` layers without room for them drops its shared padding in
    place (:meth:`RoomyKVCache.make_room`), the step evaluated ahead settled first."""
    layers = [c for c in batch.prompt_cache or [] if type(c) is RoomyKVCache and c.keys is not None
              and c._idx + tokens > c.keys.shape[2]]
    if layers:
        settle(batch)
        for c in layers:
            c.make_room(tokens)


def make_roomy(cache: list, rows: int, longest: int = 0) -> list:
    """Turn the plain ``BatchKVCache`` layers of a decode pool's ``cache`` (a
    ``GenerationBatch.prompt_cache``) into :class:`RoomyKVCache` in place, with room
    for ``rows`` sequences of up to ``longest`` tokens when they next grow (its
    :class:`RoomyKVCache` layers get the new sizes); other cache kinds (quantized,
    rotating) are left as they are. Returns ``cache``."""
    for c in cache:
        if type(c) is BatchKVCache and c.keys is not None:
            c.__class__ = RoomyKVCache
            c.batch = int(c.keys.shape[0])
        if type(c) is RoomyKVCache:
            c.rows, c.longest = rows, longest
    return cache
