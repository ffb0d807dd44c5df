"""KV events in, a prefix index out: what each engine's prefix cache holds, from its own events.

vLLM started with ``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": ..., "replay_endpoint": ...}'`` publishes, once per engine step with changes, a batch
of events over ZeroMQ (``vllm/distributed/kv_events.py``, ``ZmqEventPublisher``):

* wire: a PUB socket's multipart messages ``[topic, seq, batch]``, ``seq`` a u64 big-endian
  counter from 0, ``batch`` msgpack ``[ts, events, data_parallel_rank]``; each event a map
  tagged by ``type``: ``BlockStored`` (``block_hashes``, ``parent_block_hash``, the blocks'
  ``token_ids``, ``block_size``, per-block ``extra_keys``, ``medium``, ``group_idx``, ...),
  ``BlockRemoved`` (``block_hashes``, ``medium``), ``AllBlocksCleared``;
* replay: a ROUTER socket answers ``[b"", seq]`` from a DEALER with every buffered batch from
  ``seq`` on as ``[b"", topic, seq, batch]``, then ``[b"", b"", END_SEQ, b""]``.

The index does not recompute vLLM's block hashes (their algorithm, seed and the engine's
``PYTHONHASHSEED`` are the engine's business): a stored block's key here is a hash of its
parent's key, its token ids and its extra keys, so a prompt's blocks can be looked up from its
token ids, its ``cache_salt`` and its LoRA name alone; vLLM's hashes only map removals to keys.
A block whose parent the index never saw (stored before the subscription and beyond the
replay buffer) is not indexed, nor are its descendants: a miss, never a false hit. Only the
device tier (``medium`` GPU or unset) of the first KV cache group is indexed.

Nothing read is trusted: a malformed batch or event is counted and skipped, each index holds
at most ``max_blocks`` blocks (more stores are dropped, counted), a message is at most
``MAX_MESSAGE_BYTES``, and a replay reads at most ``MAX_REPLAY_BATCHES`` batches.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

#: The largest message a subscriber accepts (a batch of one step's events).
MAX_MESSAGE_BYTES = 64 << 20
#: Batches one replay request reads at most.
MAX_REPLAY_BATCHES = 100_000
#: The replay's end marker: seq -1.
END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: The media of the device tier (vLLM's ``MEDIUM_GPU``; events of CPU-only engines say GPU too).
DEVICE_MEDIA = (None, "GPU")
#: The index's key of "no parent": the first block of a prompt.
ROOT = 0


def block_key(parent: int, tokens: Sequence[int], extra: tuple[Any, ...] | None) -> int:
    """The index's key of one full block: its parent's key, its tokens, its extra keys."""
    return hash((parent, tuple(tokens), extra))


def extra_keys(first: bool, cache_salt: str | None, lora_name: str | None) -> tuple | None:
    """A block's extra keys as vLLM publishes them (untagged, in its order: the LoRA name,
    then the ``cache_salt``, which only the first block carries); None when there are none.
    Multimodal and prompt-embedding keys are not built here: such prompts are not looked up."""
    keys: list[Any] = []
    if lora_name:
        keys.append(lora_name)
    if first and cache_salt:
        keys.append(cache_salt)
    return tuple(keys) or None


@dataclass(eq=False)
class Lookup:
    """A prompt as the index looks it up: its token ids as the engine sees them, its
    ``cache_salt`` and LoRA name. Its blocks' keys are computed once per block size, as far as
    a lookup needs them, and shared by every index it is looked up in."""

    token_ids: Sequence[int]
    cache_salt: str | None = None
    lora_name: str | None = None
    _chains: dict[int, list[int]] = field(default_factory=dict, repr=False)

    def keys(self, size: int) -> Iterator[int]:
        """The keys of the prompt's full blocks of ``size`` tokens, first block first."""
        chain = self._chains.setdefault(size, [])
        ids = self.token_ids
        i = 0
        while True:
            if i == len(chain):
                start = i * size
                if start + size > len(ids):
                    return
                extra = extra_keys(i == 0, self.cache_salt, self.lora_name)
                chain.append(
                    block_key(chain[-1] if chain else ROOT, ids[start : start + size], extra)
                )
            yield chain[i]
            i += 1


@dataclass
class PrefixIndex:
    """The device-tier blocks one engine holds, keyed by content. Not thread-safe."""

    max_blocks: int = 1 << 20
    #: The engine's block size, from its events (None until one is seen).
    block_size: int | None = None
    #: vLLM's block hash -> the index's key.
    _keys: dict[bytes | int, int] = field(default_factory=dict)
    #: the index's key -> how many of vLLM's hashes map to it.
    _held: dict[int, int] = field(default_factory=dict)
    #: Events skipped: malformed, a block over ``max_blocks``, a parent never seen.
    malformed: int = 0
    dropped: int = 0
    orphans: int = 0

    def __len__(self) -> int:
        return len(self._held)

    def clear(self) -> None:
        self._keys.clear()
        self._held.clear()

    def reset(self) -> None:
        """Forget everything, the block size too (the engine restarted)."""
        self.clear()
        self.block_size = None

    def apply(self, event: Any) -> None:
        """One decoded event (a map with ``type``); malformed ones are counted and skipped."""
        kind = event.get("type") if isinstance(event, dict) else None
        try:
            if kind == "BlockStored":
                self._stored(event)
            elif kind == "BlockRemoved":
                self._removed(event)
            elif kind == "AllBlocksCleared":
                self.clear()
            else:
                self.malformed += 1
        except (TypeError, ValueError):
            self.malformed += 1

    def _stored(self, event: dict[str, Any]) -> None:
        if event.get("medium") not in DEVICE_MEDIA or event.get("group_idx") not in (None, 0):
            return
        hashes, tokens = event["block_hashes"], event["token_ids"]
        size, parent_hash = event["block_size"], event.get("parent_block_hash")
        extras = event.get("extra_keys") or [None] * len(hashes)
        if not (
            isinstance(hashes, list)
            and isinstance(tokens, list)
            and isinstance(extras, list)
            and type(size) is int
            and 0 < size <= 1 << 16
            and len(tokens) == size * len(hashes)
            and len(extras) == len(hashes)
            and all(isinstance(h, (bytes, int)) for h in hashes)
        ):
            raise ValueError("malformed BlockStored")
        if self.block_size is None:
            self.block_size = size
        elif size != self.block_size:
            raise ValueError("another block size")
        if parent_hash is None:
            parent = ROOT
        elif (known := self._keys.get(parent_hash)) is not None:
            parent = known
        else:
            self.orphans += len(hashes)
            return
        for i, vllm_hash in enumerate(hashes):
            extra = extras[i]
            key = block_key(parent, tokens[i * size : (i + 1) * size], _frozen(extra))
            if vllm_hash not in self._keys:
                if len(self._held) >= self.max_blocks and key not in self._held:
                    self.dropped += len(hashes) - i
                    return
                self._keys[vllm_hash] = key
                self._held[key] = self._held.get(key, 0) + 1
            parent = key

    def _removed(self, event: dict[str, Any]) -> None:
        if event.get("medium") not in DEVICE_MEDIA or event.get("group_idx") not in (None, 0):
            return
        hashes = event["block_hashes"]
        if not isinstance(hashes, list):
            raise ValueError("malformed BlockRemoved")
        for vllm_hash in hashes:
            if not isinstance(vllm_hash, (bytes, int)):
                raise ValueError("malformed BlockRemoved")
            key = self._keys.pop(vllm_hash, None)
            if key is None:
                continue
            left = self._held[key] - 1
            if left:
                self._held[key] = left
            else:
                del self._held[key]

    def cached_blocks(
        self, token_ids: Sequence[int], cache_salt: str | None = None, lora_name: str | None = None
    ) -> int:
        """How many of the prompt's leading full blocks the engine holds."""
        return self.held(Lookup(token_ids, cache_salt, lora_name))

    def held(self, prompt: Lookup) -> int:
        """How many of ``prompt``'s leading full blocks the engine holds."""
        size = self.block_size
        if size is None or not self._held:
            return 0
        held, n = self._held, 0
        for key in prompt.keys(size):
            if key not in held:
                break
            n += 1
        return n


def _frozen(extra: Any) -> tuple[Any, ...] | None:
    """A published extra-keys entry as a hashable tuple (msgpack gives lists)."""
    if extra is None:
        return None
    if not isinstance(extra, list):
        raise ValueError("malformed extra_keys")
    return tuple(tuple(x) if isinstance(x, list) else x for x in extra)


def decode_batch(payload: bytes) -> list[Any]:
    """A batch's events; raises ``ValueError`` for anything but ``[ts, events, ...]``."""
    return _decode(payload)[1]


def _decode(payload: bytes) -> tuple[float, list[Any]]:
    """A batch's timestamp and events; raises ``ValueError`` for anything else."""
    import msgspec

    try:
        batch = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise ValueError(str(exc)) from None
    if not (
        isinstance(batch, list)
        and len(batch) >= 2
        and type(batch[0]) in (int, float)
        and isinstance(batch[1], list)
    ):
        raise ValueError("not an event batch")
    return float(batch[0]), batch[1]


class Subscriber:
    """Follows one engine's KV events into ``index``: a SUB socket on ``endpoint`` (and, when
    given, replay requests to ``replay_endpoint``: at the start, for what was stored before;
    for the batches a gap in ``seq`` missed; and after ``catch_up_s`` without a message, for
    what was published while the subscription was on its way, which ZeroMQ drops and no later
    batch has shown as a gap yet); ZeroMQ reconnects by itself. A ``seq`` lower than the next
    one expected in a batch newer than the last one applied is a restarted engine (its counter
    starts at 0 again and its cache is empty; an older one is a duplicate a replay brought):
    the index is reset and rebuilt from the replay, as it is when the fleet finds the instance
    back after it was down (``resync``)."""

    def __init__(
        self,
        index: PrefixIndex,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        replay_timeout_s: float = 5.0,
        catch_up_s: float = 2.0,
    ):
        self.index = index
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.replay_timeout_s = replay_timeout_s
        self.catch_up_s = catch_up_s
        #: The next seq expected (None: nothing received yet).
        self.next_seq: int | None = None
        self.batches = 0
        self.gaps = 0
        self.restarts = 0
        self.failed = False
        self._resync = False
        #: The engine's timestamp of the last batch applied: a batch below ``next_seq`` but
        #: newer than it comes from a restarted engine; an older one was queued while a
        #: replay brought it.
        self.last_ts: float | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.wait((task,))  # a cancellation of the caller itself propagates

    def resync(self) -> None:
        """Rebuild the index from the replay soon (the engine was down: it may have restarted
        with an empty cache, its new ``seq`` already past the old one)."""
        self._resync = True

    def figures(self) -> dict[str, int]:
        """What ``/metrics`` shows of it (``vllm_pd_kv_events{instance,figure}``)."""
        index = self.index
        return {
            "blocks": len(index),
            "batches": self.batches,
            "gaps": self.gaps,
            "restarts": self.restarts,
            "malformed": index.malformed,
            "orphans": index.orphans,
            "dropped": index.dropped,
            "failed": int(self.failed),
        }

    async def _run(self) -> None:
        try:
            await self._follow()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bad endpoint, a ZeroMQ error: say so, keep serving
            self.failed = True
            logger.warning("kv events from %s stopped: %s", self.endpoint, exc)

    async def _follow(self) -> None:
        import zmq
        import zmq.asyncio

        ctx = zmq.asyncio.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)
        try:
            if self.replay_endpoint is not None:  # what was stored before we listened
                await self._replay(ctx, 0)
            while True:
                if self._resync:
                    self._resync = False
                    self._restarted()
                    if self.replay_endpoint is not None:
                        await self._replay(ctx, 0)
                if not await sub.poll(self.catch_up_s * 1000):
                    # quiet: batches published while the subscription was still on its way
                    # (ZeroMQ drops them) show no gap until a later one; ask for them now
                    if self.replay_endpoint is not None:
                        await self._replay(ctx, self.next_seq or 0)
                    continue
                frames = await sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    self.index.malformed += 1
                    continue
                seq = int.from_bytes(frames[1], "big")
                expected = self.next_seq
                if expected is not None and seq < expected:
                    if not self._newer(frames[2]):
                        continue  # queued while a replay brought it
                    self._restarted()
                    if self.replay_endpoint is not None:
                        await self._replay(ctx, 0)
                elif expected is not None and seq > expected:
                    self.gaps += 1
                    if self.replay_endpoint is not None:
                        await self._replay(ctx, expected)
                if self.next_seq is None or seq >= self.next_seq:
                    self._apply(seq, frames[2])
        finally:
            sub.close(linger=0)

    def _restarted(self) -> None:
        logger.info("kv events from %s: engine restarted: index rebuilt", self.endpoint)
        self.restarts += 1
        self.index.reset()
        self.next_seq = self.last_ts = None

    def _newer(self, payload: bytes) -> bool:
        """Whether the batch ``payload`` was published after the last one applied."""
        try:
            ts, _ = _decode(payload)
        except ValueError:
            return False
        return self.last_ts is None or ts > self.last_ts

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            ts, events = _decode(payload)
        except ValueError:
            self.index.malformed += 1
        else:
            self.last_ts = ts
            for event in events:
                self.index.apply(event)
        self.batches += 1
        self.next_seq = seq + 1

    async def _replay(self, ctx: Any, start: int) -> None:
        """Apply the buffered batches from ``start`` on (bounded in count and time)."""
        import zmq

        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        dealer.setsockopt(zmq.LINGER, 0)
        assert self.replay_endpoint is not None
        dealer.connect(self.replay_endpoint)
        try:
            await dealer.send_multipart((b"", start.to_bytes(8, "big")))
            for _ in range(MAX_REPLAY_BATCHES):
                frames = await asyncio.wait_for(dealer.recv_multipart(), self.replay_timeout_s)
                if len(frames) != 4 or frames[2] == END_SEQ:
                    return
                _, _, seq_bytes, payload = frames
                seq = int.from_bytes(seq_bytes, "big")
                if self.next_seq is None or seq >= self.next_seq:
                    self._apply(seq, payload)
        except TimeoutError:
            logger.warning("kv events: no replay from %s", self.replay_endpoint)
        finally:
            dealer.close(linger=0)
