"""Bookkeeping of the encoder cache: what is cached, who references it, what to evict next.

Owns: capacity accounting in embedding rows ("tokens"), the set of request ids referencing each
cached content hash, the FIFO order of entries no request references, and the list of hashes
evicted since it was last read. Does not own: any tensor (`EncoderCache` holds them and drops what
`take_freed` reports, lazily), nor which item to look at next (`EncoderStage` walks its queue).

Lifecycle of an entry: `allocate` (referenced) -> `free_request` of its last referrer (unreferenced,
still cached, still a hit) -> evicted by `can_allocate` only when a new allocation needs the room.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping

from mmserve.errors import CapacityError


class EncoderCacheManager:
    def __init__(self, capacity_tokens: int, compute_budget_tokens: int) -> None:
        if capacity_tokens <= 0 or compute_budget_tokens <= 0:
            raise ValueError(
                f"encoder cache capacity ({capacity_tokens}) and compute budget "
                f"({compute_budget_tokens}) must be positive (tokens)"
            )
        self.capacity_tokens = capacity_tokens  # embedding rows the cache may hold
        self.compute_budget_tokens = compute_budget_tokens  # embedding rows encoded per step
        self._num_free = capacity_tokens  # rows held by no entry (tokens)
        self._peak_cached = 0  # the most rows ever booked at once (tokens)
        self._num_freeable = 0  # rows held by unreferenced entries (tokens)
        self._sizes: dict[str, int] = {}  # hash -> rows; every entry in the books
        self._refs: dict[str, set[str]] = {}  # hash -> ids of the requests referencing it
        self._freeable: OrderedDict[str, int] = OrderedDict()  # unreferenced hash -> rows, oldest first
        # NOTE: dict-as-ordered-set so that freeing a request queues its entries in a stable order.
        self._by_request: dict[str, dict[str, None]] = {}  # request id -> hashes it references
        self._freed: list[str] = []  # evicted since the last take_freed()

    # ---- validation (up front, so an impossible item fails instead of waiting forever) ----

    def validate_item(self, num_tokens: int) -> None:
        """Raise CapacityError if an item of `num_tokens` rows could never be scheduled."""
        if num_tokens <= 0:
            raise ValueError(f"an item must embed to at least one row, got {num_tokens}")
        if num_tokens > self.capacity_tokens:
            raise CapacityError(
                f"an image needs {num_tokens} embedding tokens but the encoder cache holds at most "
                f"{self.capacity_tokens} (EncoderConfig.cache_capacity_tokens)"
            )

    def validate_request(self, sizes: Mapping[str, int]) -> None:
        """Raise CapacityError if a request's distinct items (hash -> rows) cannot be held at once.

        A request keeps references to all its items until its embeddings are handed out, so their sum must fit.
        """
        for num_tokens in sizes.values():
            self.validate_item(num_tokens)
        total = sum(sizes.values())
        if total > self.capacity_tokens:
            raise CapacityError(
                f"the request's {len(sizes)} distinct images need {total} embedding tokens together "
                f"but the encoder cache holds at most {self.capacity_tokens} "
                "(EncoderConfig.cache_capacity_tokens)"
            )

    # ---- the scheduling contract ----

    def check_and_update_cache(self, request_id: str, mm_hash: str) -> bool:
        """On a hit, record `request_id` as a referrer (un-freeing the entry) and return True."""
        if mm_hash not in self._sizes:
            return False
        if not self._refs[mm_hash]:
            self._num_freeable -= self._freeable.pop(mm_hash)
        self._add_ref(request_id, mm_hash)
        return True

    def can_allocate(self, num_tokens: int, compute_budget_left: int) -> bool:
        """Whether `num_tokens` new rows fit this step; evicts unreferenced entries FIFO if needed.

        Evicts only when the allocation will then succeed, so a refusal leaves the books unchanged.
        """
        if num_tokens > compute_budget_left:
            return False
        if num_tokens > self._num_free + self._num_freeable:
            return False
        while self._num_free < num_tokens:
            self._evict_oldest()
        return True

    def allocate(self, request_id: str, mm_hash: str, num_tokens: int) -> None:
        """Book `num_tokens` rows for a new entry referenced by `request_id` (after can_allocate)."""
        if mm_hash in self._sizes:
            raise RuntimeError(f"encoder cache entry {mm_hash} is already allocated")
        if num_tokens > self._num_free:
            raise RuntimeError(
                f"allocate({num_tokens}) with only {self._num_free} free tokens; call can_allocate first"
            )
        self._sizes[mm_hash] = num_tokens
        self._refs[mm_hash] = set()
        self._num_free -= num_tokens
        self._peak_cached = max(self._peak_cached, self.num_cached_tokens)
        self._add_ref(request_id, mm_hash)

    def touch(self, mm_hash: str) -> None:
        """An unreferenced entry becomes the newest of the freeable, the last to be evicted (a request found it
        and was served without holding it); a referenced or unknown one is left as it is."""
        if mm_hash in self._freeable:
            self._freeable.move_to_end(mm_hash)

    def free_request(self, request_id: str) -> None:
        """Drop every reference of `request_id`; entries left unreferenced stay cached (freeable)."""
        for mm_hash in self._by_request.pop(request_id, {}):
            refs = self._refs[mm_hash]
            refs.discard(request_id)
            if not refs:
                self._freeable[mm_hash] = self._sizes[mm_hash]
                self._num_freeable += self._sizes[mm_hash]

    def discard(self, hashes: Iterable[str]) -> None:
        """Forget entries outright, referenced or not (their tensors were never produced)."""
        for mm_hash in hashes:
            if mm_hash not in self._sizes:
                continue
            for request_id in self._refs.pop(mm_hash):
                self._by_request[request_id].pop(mm_hash, None)
            if mm_hash in self._freeable:
                self._num_freeable -= self._freeable.pop(mm_hash)
            self._num_free += self._sizes.pop(mm_hash)
            self._freed.append(mm_hash)

    def take_freed(self) -> list[str]:
        """Hashes evicted since the last call, for the tensor cache to drop."""
        freed, self._freed = self._freed, []
        return freed

    # ---- introspection ----

    @property
    def num_free_tokens(self) -> int:
        """Rows held by no entry (unreferenced entries not counted as free)."""
        return self._num_free

    @property
    def num_freeable_tokens(self) -> int:
        """Rows held by unreferenced entries, reclaimable on demand."""
        return self._num_freeable

    @property
    def num_cached_tokens(self) -> int:
        return self.capacity_tokens - self._num_free

    @property
    def peak_cached_tokens(self) -> int:
        """The most rows ever booked at once; never above `capacity_tokens`."""
        return self._peak_cached

    @property
    def num_cached(self) -> int:
        """Entries in the books, referenced or not."""
        return len(self._sizes)

    def refcount(self, mm_hash: str) -> int:
        """Requests referencing `mm_hash` (0 if unreferenced or not cached)."""
        return len(self._refs.get(mm_hash, ()))

    def referencing_requests(self) -> list[str]:
        """Ids of the requests that hold at least one reference (a sorted copy)."""
        return sorted(self._by_request)

    def referrers(self, mm_hash: str) -> set[str]:
        """Ids of the requests referencing `mm_hash` (a copy)."""
        return set(self._refs.get(mm_hash, ()))

    def __contains__(self, mm_hash: object) -> bool:
        return mm_hash in self._sizes

    def freeable_order(self) -> list[str]:
        """Unreferenced hashes, next to be evicted first."""
        return list(self._freeable)

    # ---- internals ----

    def _add_ref(self, request_id: str, mm_hash: str) -> None:
        self._refs[mm_hash].add(request_id)
        self._by_request.setdefault(request_id, {})[mm_hash] = None

    def _evict_oldest(self) -> None:
        mm_hash, num_tokens = self._freeable.popitem(last=False)
        self._num_freeable -= num_tokens
        self._num_free += num_tokens
        del self._sizes[mm_hash]
        del self._refs[mm_hash]
        self._freed.append(mm_hash)
