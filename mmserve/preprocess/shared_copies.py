"""A shared processor cache's own copies: an entry is its maker's object until its first hit at the shared
store, which copies it into an object the store owns.

Owns: copying an entry on its first hit (one copy per entry at a time, the hit waiting for it at most
`KEEP_WAIT_S`), dropping an entry whose maker died (and every other entry that maker made, found by the
process that made each), an entry adopted again while the first one's copy was in flight (it takes the
dropped one's place), and taking back the hit a lost entry counted. Does not own the index (ProcessorCache),
how an object is read or put (the `read` and `put` it is given: the Ray object store's in the app), nor the
store's calls (deployments/cache_store.py).

NOTE: not copied on sight because most images are seen once and most repeats are found in their maker's own
refs: copying each new one cost its request time in the other processes' hops and put every image in the
object store twice (docs/benchmarks.md). A hit answers with the copy, so no answer is a reference whose
maker has died (the request would fail at the encoder and be retried).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from mmserve.messages import ProcessedItem, StoredItem
from mmserve.preprocess.processor_cache import CachedItem, ProcessorCache

log = logging.getLogger(__name__)
# NOTE: under the client's lookup timeout (deployments/cache_store.py: LOOKUP_TIMEOUT_S): a copy slower than
# this (another node's object, a maker whose node is being declared dead) answers that hit as a miss, and goes on.
KEEP_WAIT_S = 2.0


class ItemLostError(RuntimeError):
    """A stored item's object cannot be read any more (lost, or not read in time)."""


class MakerGoneError(ItemLostError):
    """A stored item's object died with the process that made it (and so did every other it made)."""


Read = Callable[[StoredItem], Awaitable[ProcessedItem]]  # a stored item's pixels; ItemLostError if gone
Put = Callable[[ProcessedItem], Any]  # an object this process owns holding the pixels: its reference


@dataclass
class _Copy:
    item: StoredItem  # the maker's entry being copied
    future: asyncio.Future[StoredItem | None]  # the kept entry, or None if the maker's object was gone
    late: bool = False  # a lookup gave up waiting for it: the next ones answer a miss at once


class Keeper:
    """Run on the store's event loop only (no locking). NOTE: `put` runs in a worker thread (a put of
    several MiB on the loop would hold every other lookup meanwhile)."""

    def __init__(self, cache: ProcessorCache, read: Read, put: Put) -> None:
        self.cache, self._read, self._put = cache, read, put
        self._copies: dict[str, _Copy] = {}  # content hash -> its copy in the making
        self._makers: dict[str, str] = {}  # content hash -> the process that made its entry (until kept)
        self._spares: dict[str, tuple[StoredItem, str | None]] = {}  # adopted again during a copy, with maker

    def adopt(self, key: str, item: StoredItem, source: str | None, maker: str | None) -> None:
        """Index `item` (its maker's object) if `key` is new and it fits; else link the source to the entry."""
        if key in self.cache:  # another replica made it too, meanwhile (maybe from other bytes); keep the first
            if source is not None:
                self.cache.link(source, key)
            if key in self._copies:  # NOTE: if that first one is found lost, this one takes its place
                self._spares[key] = (item, maker)
            return
        if self.cache.put(key, item, source) and maker is not None:
            self._makers[key] = maker
            if len(self._makers) > 2 * len(self.cache) + 64:  # NOTE: bounded: forget entries the index let go
                self._makers = {k: m for k, m in self._makers.items() if _borrowed(self.cache.peek(k))}

    async def kept(self, key: str, item: CachedItem | None, *, counted: bool,
                   wait_s: float | None = KEEP_WAIT_S) -> StoredItem | None:
        """`item` (the entry for `key`) as the store's own copy, made now if it is still its maker's; None on a
        miss, if the maker's object is gone (the entry is dropped), or if the copy takes over `wait_s` (it goes
        on). `counted`: a request's lookup (made with `hit=False`), whose hit is counted here when it is one."""
        found = await self._kept(key, item, wait_s)
        if found is not None and counted:
            self.cache.count_hit()
        return found

    async def _kept(self, key: str, item: CachedItem | None, wait_s: float | None) -> StoredItem | None:
        if not isinstance(item, StoredItem):
            return None
        if item.kept:
            return item
        copy = self._copy_of(key, item)
        if copy.late and wait_s is not None:
            kept = None  # NOTE: its read is slow (a hung node): each lookup would wait again, then process anyway
        else:
            try:  # NOTE: shielded: a caller that gives up leaves the copy to the next
                kept = await asyncio.wait_for(asyncio.shield(copy.future), wait_s)
            except TimeoutError:
                copy.late, kept = True, None
        return kept

    def made_by(self, maker: str) -> list[str]:
        """The keys whose entries are still the objects of the worker `maker` (none copied yet)."""
        return [key for key, m in self._makers.items() if m == maker and _borrowed(self.cache.peek(key))]

    def _copy_of(self, key: str, item: StoredItem) -> _Copy:
        """The copy of `item` in the making (one per entry at a time)."""
        copy = self._copies.get(key)
        if copy is not None and copy.item == item:
            return copy
        # NOTE: the maker read now: by the time its object is found lost, the key may be another maker's; and
        # only if `item` is still the entry (a caller may hold an entry a spare has replaced since)
        maker = self._makers.get(key) if self.cache.peek(key) == item else None
        made = _Copy(item, asyncio.ensure_future(self._copy(key, item, maker)))
        self._copies[key] = made

        def done(_: asyncio.Future[StoredItem | None]) -> None:
            if self._copies.get(key) is made:
                del self._copies[key]
                self._spares.pop(key, None)  # NOTE: not needed past the copy, whatever its outcome

        made.future.add_done_callback(done)
        return made

    async def _copy(self, key: str, item: StoredItem, maker: str | None) -> StoredItem | None:
        """Copy the maker's object into one this replica owns and swap it into the index (if still held)."""
        try:
            made = await self._read(item)
        except MakerGoneError:
            log.info("processed item %s died with its maker %s; dropping what that maker made", key, maker)
            self._drop(key, item)
            self._drop_made_by(maker)
            return None
        except Exception as exc:  # NOTE: any failure: a lookup answers a miss, never an error
            expected = isinstance(exc, ItemLostError)  # (logged without a traceback)
            log.log(logging.INFO if expected else logging.WARNING, "processed item %s could not be read (%s: %s); "
                    "dropped", key, type(exc).__name__, exc, exc_info=not expected)
            self._drop(key, item)
            return None
        try:
            kept = StoredItem(ref=await asyncio.to_thread(self._put, made), num_tiles=item.num_tiles,
                              nbytes=item.nbytes, kept=True)
        except Exception:  # e.g. the object store full: the maker's object still serves; the next hit tries again
            log.warning("could not copy processed item %s", key, exc_info=True)
            return item
        self.cache.replace(key, kept)  # NOTE: the same content hash: the copy serves any entry of this key
        self._makers.pop(key, None)
        self._spares.pop(key, None)
        return kept

    def _drop(self, key: str, item: StoredItem) -> None:
        """Forget the entry `item` of `key` (not one adopted since); a spare adopted meanwhile takes its place."""
        if self.cache.peek(key) == item:
            self.cache.discard(key)
            self._makers.pop(key, None)
        spare, maker = self._spares.pop(key, (None, None))
        if spare is not None and key not in self.cache:
            self.adopt(key, spare, None, maker)

    def _drop_made_by(self, maker: str | None) -> None:
        """Forget every entry still the object of the worker `maker` (dead): each would be a failed copy later,
        and meanwhile holds its bytes of the bound. An entry with a copy under way is left to that copy (its
        read may be done already)."""
        if maker is None:
            return
        for key in [k for k, m in self._makers.items() if m == maker and k not in self._copies]:
            entry = self.cache.peek(key)
            if isinstance(entry, StoredItem) and not entry.kept:
                self._drop(key, entry)


def _borrowed(entry: CachedItem | None) -> bool:
    """An entry that is still its maker's object."""
    return isinstance(entry, StoredItem) and not entry.kept
