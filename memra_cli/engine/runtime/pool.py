"""One pool for every per-session storage: target KV caches (and, later, recurrent state) and
drafter KV caches, reused across sessions within a byte budget.

Why a pool at all: a CUDA graph binds the addresses it was captured with, so a graph captured
over one session's cache storage can only be replayed by a later session that gets the same
storage. The pool hands idle storages (with the graphs kept on them) to the next session that asks
for the same key, and drops the least recently used idle ones when they would hold more than
`idle_budget` bytes. A storage in use is never evicted. An evicted storage takes its graphs with
it, so nothing can replay over freed memory.

Keys say what can be shared: `(owner token, kind, rows)`. An owner (a model, a drafter) gets a
token that is never reused (`owner_token`), and when the owner is garbage-collected its idle
storages are dropped: a storage whose graphs read a freed model's weights can never be handed to
a new model that happens to get the same `id()`. Storages carry `nbytes` and a `graphs` dict; the
pool does not look inside them.
"""

from __future__ import annotations

import itertools
import logging
import weakref
from collections import OrderedDict
from typing import Callable, Hashable, Protocol

log = logging.getLogger(__name__)

DEFAULT_IDLE_BUDGET = 4 << 30  # bytes of idle storages kept for reuse (graphs ride along)


class Storage(Protocol):
    nbytes: int
    graphs: dict


class StoragePool:
    """Idle storages by key, least recently released first; `acquire` / `release` per session."""

    def __init__(self, idle_budget: int | None = DEFAULT_IDLE_BUDGET):
        if idle_budget is not None and idle_budget < 0:
            raise ValueError(f"idle_budget must be >= 0 bytes or None, got {idle_budget}")
        self.idle_budget = idle_budget
        self._idle: OrderedDict[int, tuple[Hashable, Storage]] = OrderedDict()  # id -> (key, storage)
        self._live: dict[int, Hashable] = {}  # id(storage) -> key, for storages handed out
        self._tokens: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # owner -> token
        self._next_token = itertools.count()
        self.evictions = 0

    def owner_token(self, owner: object) -> int:
        """A token for `owner` (a model or drafter) that no other object ever gets, and a hook
        that drops the owner's idle storages when it is collected."""
        token = self._tokens.get(owner)
        if token is None:
            token = self._tokens[owner] = next(self._next_token)
            # the hook holds the pool weakly: a pool (its idle storages and their graphs) must die
            # with its runner, not live as long as the model it served
            weakref.finalize(owner, StoragePool._drop_owner_of, weakref.ref(self), token)
        return token

    @staticmethod
    def _drop_owner_of(pool_ref: weakref.ref, token: int) -> None:
        pool = pool_ref()
        if pool is not None:
            pool._drop_owner(token)

    def _drop_owner(self, token: int) -> None:
        for sid in [sid for sid, (key, _) in self._idle.items() if isinstance(key, tuple) and key and key[0] == token]:
            _, storage = self._idle.pop(sid)
            storage.graphs.clear()

    @property
    def idle_bytes(self) -> int:
        return sum(s.nbytes for _, s in self._idle.values())

    @property
    def live_count(self) -> int:
        return len(self._live)

    @property
    def idle_count(self) -> int:
        return len(self._idle)

    def acquire(self, key: Hashable, make: Callable[[], Storage]) -> Storage:
        """An idle storage of `key` (the most recently released: its graphs are warm), else a
        new one from `make()`."""
        for sid in reversed(self._idle):
            k, storage = self._idle[sid]
            if k == key:
                del self._idle[sid]
                self._live[sid] = key
                return storage
        storage = make()
        self._live[id(storage)] = key
        return storage

    def release(self, storage: Storage) -> None:
        """Return a storage handed out by `acquire` (a second release, or one of another pool, is
        a no-op), then evict idle storages past the budget."""
        key = self._live.pop(id(storage), None)
        if key is None:
            return
        self._idle[id(storage)] = (key, storage)
        self._evict()

    def clear(self) -> None:
        """Drop every idle storage (and its graphs)."""
        self._idle.clear()

    def _evict(self) -> None:
        if self.idle_budget is None:
            return
        while self._idle and self.idle_bytes > self.idle_budget:
            _, (key, storage) = self._idle.popitem(last=False)
            storage.graphs.clear()
            self.evictions += 1
            log.debug("pool: evicted an idle storage %s (%d bytes)", key, storage.nbytes)
