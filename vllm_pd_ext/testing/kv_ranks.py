"""Engine ranks of our connectors' worker side over CPU KV caches, without vLLM engines.

What ``benchmarks/tp_transfer.py`` and its test share: a model's KV for a prompt, made the
same in every process from a seed; the head slice of it one tensor parallel rank holds; a
prefill rank in its own process, as in vLLM, or in this one (a real :class:`TransferWorker`
holding its blocks for a READ, as after a prefill step); a decode rank's READ of one request
from every prefill rank whose heads it holds, through the worker's own code path; and the
check that every byte landed in the right head slice of the right block.

Caches are shaped like vLLM's CPU backend, head-major: one tensor per layer,
``[blocks, kv_heads of the rank, block_size, 2 * head_dim]``. Needs vLLM and torch, as the
worker does.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm_pd_ext.connectors.common.config import TransferConfig
from vllm_pd_ext.connectors.common.metadata import (
    PdTransferMetadata,
    RecvSpec,
    RemoteRef,
    SendSpec,
)
from vllm_pd_ext.connectors.common.worker import TransferWorker
from vllm_pd_ext.transfer_params import READ

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    import torch

HOST = "127.0.0.1"
#: How long a prefill rank answers a command within, and a load may take.
REPLY_TIMEOUT_S = 120.0
#: How long a prefill rank's process may take to start (import, fill its caches) on a busy host.
START_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class KVShape:
    """A model's KV cache shape: ``layers`` layers of ``kv_heads`` KV heads of ``head_dim``,
    ``block_size`` tokens a block, ``dtype`` a torch dtype name."""

    layers: int
    kv_heads: int
    head_dim: int
    block_size: int = 16
    dtype: str = "bfloat16"

    @property
    def itemsize(self) -> int:
        import torch

        return int(torch.empty(0, dtype=getattr(torch, self.dtype)).element_size())

    @property
    def token_bytes(self) -> int:
        """KV bytes of one token, every layer and head, K and V."""
        return self.layers * self.kv_heads * 2 * self.head_dim * self.itemsize

    def layer_name(self, layer: int) -> str:
        return f"model.layers.{layer}.self_attn.attn"


def model_kv(
    shape: KVShape, num_blocks: int, seed: int, layer: int, heads: range | None = None
) -> torch.Tensor:
    """Layer ``layer`` of the model's KV over ``num_blocks`` blocks, of KV heads ``heads``
    (default: all): the same for the same arguments in every process (normal values, so no
    NaN in any dtype)."""
    import torch

    parts = []
    for head in heads if heads is not None else range(shape.kv_heads):
        g = torch.Generator().manual_seed((seed * 100_003 + layer) * 1_009 + head)
        dims = (num_blocks, 1, shape.block_size, 2 * shape.head_dim)
        parts.append(torch.randn(dims, generator=g).to(getattr(torch, shape.dtype)))
    return torch.cat(parts, dim=1)


def rank_caches(
    shape: KVShape, num_blocks: int, tp_size: int, tp_rank: int, seed: int | None
) -> dict[str, torch.Tensor]:
    """The KV caches of TP rank ``tp_rank`` of ``tp_size``: its heads of :func:`model_kv`
    (``seed``), or zeros (``seed`` None)."""
    import torch

    per = shape.kv_heads // tp_size
    out = {}
    for layer in range(shape.layers):
        if seed is None:
            dims = (num_blocks, per, shape.block_size, 2 * shape.head_dim)
            t = torch.zeros(dims, dtype=getattr(torch, shape.dtype))
        else:
            heads = range(tp_rank * per, (tp_rank + 1) * per)
            t = model_kv(shape, num_blocks, seed, layer, heads)
        out[shape.layer_name(layer)] = t
    return out


def rank_worker(
    role: str,
    engine_id: str,
    side_port: int,
    backend: str,
    shape: KVShape,
    num_blocks: int,
    tp_size: int = 1,
    tp_rank: int = 0,
) -> TransferWorker:
    """A worker for TP rank ``tp_rank`` of engine ``engine_id`` (side channel at
    ``side_port`` + rank), over ``backend`` on 127.0.0.1, for ``shape`` split over
    ``tp_size`` ranks; its caches are not registered yet."""
    cfg = TransferConfig(
        backend=backend,
        backend_settings={"host": HOST},
        side_channel_host=HOST,
        side_channel_port=side_port,
        transfer_timeout_s=REPLY_TIMEOUT_S,
    )
    return TransferWorker(
        cfg,
        engine_id=engine_id,
        role=role,
        tp_rank=tp_rank,
        tp_size=tp_size,
        side_host=HOST,
        side_port=side_port,
        kv_ip=HOST,
        num_blocks=num_blocks,
        block_sizes=(shape.block_size,),
        model={"layers": shape.layers, "kv_heads": shape.kv_heads},
        head_major={0: shape.kv_heads // tp_size},
        heads_first=True,  # vLLM's CPU layout, declared as the shell declares it
    )


def poll(fn: Any, what: str, timeout: float = REPLY_TIMEOUT_S, interval: float = 0.001) -> Any:
    """``fn()`` once it is truthy, trying every ``interval`` seconds; TimeoutError after
    ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        got = fn()
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(interval)


# ---------------------------------------------------------------------- prefill ranks
class HoldingRank:
    """TP rank ``tp_rank`` of a prefill engine: a real worker whose caches hold its heads of
    :func:`model_kv` (``seed``), holding finished requests' blocks for READs."""

    def __init__(
        self,
        engine_id: str,
        side_port: int,
        backend: str,
        shape: KVShape,
        num_blocks: int,
        seed: int,
        tp_size: int = 1,
        tp_rank: int = 0,
    ) -> None:
        self.worker = rank_worker(
            "kv_producer", engine_id, side_port, backend, shape, num_blocks, tp_size, tp_rank
        )
        try:
            self.worker.register_kv_caches(rank_caches(shape, num_blocks, tp_size, tp_rank, seed))
        except BaseException:
            self.worker.shutdown()
            raise

    def hold(self, req: str, blocks: tuple[int, ...]) -> None:
        """The prefill step finished ``req``: hold its ``blocks`` for a READ."""
        w = self.worker
        w.bind(PdTransferMetadata(send=[SendSpec(req, READ, (tuple(blocks),))]))
        if w.get_finished({req}) != (None, None):
            raise RuntimeError(f"{req} was not held")

    def wait_released(self, req: str) -> None:
        """Until the decode side's "done" freed ``req``."""
        poll(lambda: req in (self.worker.get_finished(set())[0] or ()), f"{req}'s release")

    def handle(self, cmd: str, req: str, blocks: tuple[int, ...]) -> None:
        if cmd == "hold":
            self.hold(req, blocks)
        elif cmd == "released":
            self.wait_released(req)
        else:
            raise ValueError(cmd)

    def shutdown(self) -> None:
        self.worker.shutdown()


def _rank_process(conn: Connection, args: dict[str, Any]) -> None:
    try:
        rank = HoldingRank(**{**args, "shape": KVShape(**args["shape"])})
    except Exception as e:
        conn.send(("err", f"{type(e).__name__}: {e}"))
        return
    try:
        conn.send(("ok", None))
        while True:
            cmd, req, blocks = conn.recv()
            if cmd == "exit":
                conn.send(("ok", None))
                return
            try:
                rank.handle(cmd, req, blocks)
                conn.send(("ok", None))
            except Exception as e:
                conn.send(("err", f"{type(e).__name__}: {e}"))
    finally:
        rank.shutdown()


class RankProcess:
    """A :class:`HoldingRank` (same arguments) in a spawned process: ``send`` a command
    (``hold`` or ``released``), then wait for its ``result``."""

    def __init__(self, **args: Any) -> None:
        args["shape"] = vars(args["shape"])
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_rank_process, args=(child, args), daemon=True)
        self.proc.start()
        child.close()

    def send(self, cmd: str, req: str = "", blocks: tuple[int, ...] = ()) -> None:
        self._conn.send((cmd, req, blocks))

    def result(self, what: str, timeout: float = REPLY_TIMEOUT_S) -> None:
        """Wait for the answer to the last command; RuntimeError if it failed."""
        if not self._conn.poll(timeout):
            raise TimeoutError(f"prefill rank did not answer {what!r}")
        status, value = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"prefill rank failed {what!r}: {value}")

    def stop(self) -> None:
        try:
            if self.proc.is_alive():
                self.send("exit")
                self.result("exit")
        finally:
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(5)


class _LocalRank:
    """A :class:`HoldingRank` in this process, behind :class:`RankProcess`'s calls."""

    def __init__(self, **args: Any) -> None:
        self.rank = HoldingRank(**args)
        self._error: Exception | None = None

    def send(self, cmd: str, req: str = "", blocks: tuple[int, ...] = ()) -> None:
        self._error = None
        try:
            self.rank.handle(cmd, req, blocks)
        except Exception as e:
            self._error = e

    def result(self, what: str, timeout: float = REPLY_TIMEOUT_S) -> None:
        if self._error is not None:
            raise RuntimeError(f"prefill rank failed {what!r}: {self._error}") from self._error

    def stop(self) -> None:
        self.rank.shutdown()


class PrefillEngine:
    """A prefill engine of ``tp_size`` ranks, each in its own process (``spawn``, as in vLLM)
    or all in this one."""

    def __init__(
        self,
        engine_id: str,
        side_port: int,
        backend: str,
        shape: KVShape,
        num_blocks: int,
        seed: int,
        tp_size: int,
        spawn: bool = True,
    ) -> None:
        self.engine_id, self.side_port, self.tp_size = engine_id, side_port, tp_size
        self.ranks: list[RankProcess | _LocalRank] = []
        kind = RankProcess if spawn else _LocalRank
        try:
            for r in range(tp_size):
                self.ranks.append(
                    kind(
                        engine_id=engine_id,
                        side_port=side_port,
                        backend=backend,
                        shape=shape,
                        num_blocks=num_blocks,
                        seed=seed,
                        tp_size=tp_size,
                        tp_rank=r,
                    )
                )
            if spawn:
                for rank in self.ranks:
                    rank.result("start", START_TIMEOUT_S)
        except BaseException:
            self.stop()
            raise

    def _all(self, cmd: str, req: str, blocks: tuple[int, ...] = ()) -> None:
        for rank in self.ranks:
            rank.send(cmd, req, blocks)
        for rank in self.ranks:
            rank.result(cmd)

    def hold(self, req: str, blocks: tuple[int, ...]) -> None:
        """Every rank holds ``blocks`` of ``req`` for a READ (as its prefill step ended)."""
        self._all("hold", req, blocks)

    def wait_released(self, req: str) -> None:
        """Until every rank freed ``req`` (the decode side said done)."""
        self._all("released", req)

    def ref(self, req: str) -> RemoteRef:
        """What a READ answer tells the decode side about ``req`` here."""
        return RemoteRef(self.engine_id, HOST, self.side_port, req, tp_size=self.tp_size)

    def stop(self) -> None:
        for rank in self.ranks:
            rank.stop()


# ---------------------------------------------------------------------- the decode rank
@dataclass(frozen=True)
class Load:
    """One READ as the decode worker did it: ``wall_s`` from ``start_load_kv`` until
    ``get_finished`` reported it (polled every millisecond), ``load_s`` and ``nbytes`` as
    the worker's own stats recorded them (its handshake with a new peer, the renewals, the
    reads, the "done" notices)."""

    wall_s: float
    load_s: float
    nbytes: int


def read_request(
    d: TransferWorker, ref: RemoteRef, pairs: tuple[tuple[int, int], ...], req: str
) -> Load:
    """Decode worker ``d`` loads ``req`` (its ``pairs``: (local, remote) blocks) from the
    prefill engine ``ref`` names, as the runner drives it: bind, start, poll; RuntimeError
    if the load failed."""
    d.stats.take()  # start a fresh interval
    local = tuple(loc for loc, _ in pairs)
    t0 = time.perf_counter()
    d.bind(PdTransferMetadata(recv=[RecvSpec(req, READ, ref, (pairs,), (local,))]))
    d.start_load_kv()
    poll(lambda: req in (d.get_finished(set())[1] or ()), f"the load of {req}")
    wall = time.perf_counter() - t0
    errors = d.get_block_ids_with_load_errors()
    stats = d.stats.take()
    if errors or stats is None or stats.data["failures"] or len(stats.data["seconds"]) != 1:
        raise RuntimeError(f"the load of {req} failed: {len(errors)} blocks with errors")
    return Load(wall, stats.data["seconds"][0], stats.data["bytes"][0])


def check_landed(
    shape: KVShape,
    decode: dict[str, torch.Tensor],
    model: dict[str, torch.Tensor],
    pairs: tuple[tuple[int, int], ...],
    tp_size: int = 1,
    tp_rank: int = 0,
) -> int:
    """Bytes of decode rank ``tp_rank`` of ``tp_size``'s caches ``decode`` that equal the
    model's KV (``model``: :func:`model_kv` per layer name) of its heads, block by block
    (``pairs``: (decode block, prefill block)); AssertionError naming the first layer that
    differs."""
    import torch

    per = shape.kv_heads // tp_size
    local = torch.tensor([loc for loc, _ in pairs])
    remote = torch.tensor([r for _, r in pairs])
    checked = 0
    for name, cache in decode.items():
        got = cache.index_select(0, local)
        want = model[name].index_select(0, remote)[:, tp_rank * per : (tp_rank + 1) * per]
        if not torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8)):
            raise AssertionError(f"{name}: the decode blocks differ from the model's heads")
        checked += got.numel() * got.element_size()
    return checked
