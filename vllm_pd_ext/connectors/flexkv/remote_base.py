"""The remote tier's seam: what the scheduler and the worker ask of a store every instance of
a fleet reaches.

:class:`RemoteBlockStore` is all they call; :class:`~.remote.MooncakeBlockStore` implements
it over Mooncake Store, and a second backend (an LMCache server, Redis, ...) would implement
exactly this. A backend stores each block as the bytes a block file holds
(:func:`~.store.block_header`, then the payload) under a name of its choosing per (key, rank),
and checks what it gets back with :func:`~.store.check_header` and :func:`~.store.check_payload`,
so the fleet key's MAC and the layout checks are ours whatever the store. Misses and store
failures are misses: a backend that stops answering says so by returning ``False`` from
:meth:`RemoteBlockStore.exists_many` and raising :class:`OSError` from reads and writes, never
by stalling the engine.

This module imports nothing of any store, so a backend's module and the tests can import it
alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol


class RemoteBlockStore(Protocol):
    """KV blocks by prefix key in a store shared by a fleet. One object per process side: the
    scheduler's asks only what exists (:meth:`exists_many`), each worker's reads and writes
    its rank's blocks on its I/O threads (every method but :meth:`close` may be called from
    several threads at once)."""

    def exists_many(self, keys: Sequence[str], ranks: int = 1) -> list[bool]:
        """Scheduler: whether the store holds each of ``keys`` for all of ``ranks`` ranks, in
        one call for the whole lookup (a store that is down: all ``False``, no call made)."""
        ...

    def write(self, key: str, payload: Any, fingerprint: str, rank: int = 0) -> int:
        """Worker I/O thread: put one block (``payload``: a buffer or the block's pieces, in
        order), replacing any object under its name; returns the bytes put. Raises
        :class:`OSError` when the store refuses or is down (the save is then skipped)."""
        ...

    def read_into(self, key: str, out: Any, fingerprint: str, rank: int = 0) -> int:
        """Worker I/O thread: get and check one block into ``out`` (a buffer or the block's
        pieces); returns the bytes got. ``FileNotFoundError`` when the store has none,
        :class:`~.store.BlockFileError` when it fails its checks (the object is dropped),
        :class:`OSError` when the store fails."""
        ...

    def fetching(
        self, sizes: Mapping[str, int], rank: int = 0
    ) -> AbstractContextManager[Mapping[str, bytes | memoryview]]:
        """Worker load thread: the objects of the keys of ``sizes`` (each block's payload
        bytes) got in as few calls as the store allows, for :meth:`check_into`; valid only
        inside the ``with`` (they may be views into a buffer the store wrote). A missing
        object is ``b""``; a missing key (the store down or the call failed) a miss too."""
        ...

    def check_into(
        self, key: str, raw: bytes | memoryview, out: Any, fingerprint: str, rank: int = 0
    ) -> int:
        """Worker I/O thread: :meth:`read_into` for an object already got (``raw``, from
        :meth:`fetching`); same returns and errors."""
        ...

    def close(self) -> None:
        """Worker shutdown: release the store's client (and any memory it registered with
        the store); nothing is called after it."""
        ...
