"""KV-transfer bandwidth between two processes: our transport next to NIXL and the floors.

Moves the KV blocks of a Qwen2.5-7B-shaped cache (28 layers, 4 KV heads, head dim 128, bf16,
16-token blocks: one K or V block of one layer is 16 KiB, 56 KiB per token) for 1k, 8k and
32k-token prompts from a "prefill" process into a "decode" process, the way a P/D connector
does. Prefill blocks are 0..n-1 (a fresh engine); three cache layouts:

* ``per-layer-contiguous``: vLLM's usual ``[layer][K|V][block]`` caches, decode blocks 0..n-1:
  spans coalesce into one K and one V run per layer (the best case);
* ``per-layer-scattered``: same caches, random decode blocks: one 16 KiB span per K or V block
  per layer (the worst case: 114,688 spans for 32k tokens);
* ``cross-layer-scattered``: a ``[block][layer][K|V]`` cache (vLLM's cross-layer layout),
  random decode blocks: one 896 KiB span per block.

Each side registers its whole cache as one region. One phase per transport family, each with
its own decode process: our transport over Mooncake, our transport over its own TCP data
path, then the NIXL variants (so that no engine's threads compete with another's for the
host's cores). In a phase every configuration runs ``--runs`` interleaved rounds of the floors and
the transports; medians are reported, ``x/tcp`` is the median of per-round ratios; a
transport slower than ``--budget-s`` runs fewer rounds or skips a size it would need over
twice that for. The first round of each is checked byte for byte on 32 random spans.
``x/memcpy`` is the median of per-round ratios to the memcpy floor.

Latency rows: small transfers (4 KiB to 1 MiB, one span or scattered 16 KiB blocks), each
mover ``SMALL_REPS`` times in a row per round (one write and its wait each, NIXL one
``initialize_xfer`` + ``transfer``), interleaved by round as above: the median microseconds
of one transfer, which for the smallest is the fixed cost per transfer.

Printed side by side, in one run, on the host it runs on (the JSON records which):

* memcpy: ``numpy.copyto`` of a large buffer in one process (a floor: no copy is faster);
* loopback TCP: one socket between the two processes, 4 MiB ``sendall``/``recv_into``;
* ours-mc: ``vllm_pd_ext.transport`` ``mooncake`` backend over TCP (one batched write per
  layer, or one for the cross-layer cache, then ``wait_all``);
* ours-tcp: ``vllm_pd_ext.transport`` ``tcp`` backend (our own data path: one persistent
  socket, ``sendmsg``/``recvmsg_into`` straight from and into the registered caches), same
  calls;
* ours-cma: ``vllm_pd_ext.transport`` ``cma`` backend (tcp's control path over a Unix socket;
  the decode side's server copies each batch with ``process_vm_readv`` from the prefill's
  cache), same calls;
* NIXL 1.5.1, UCX backend, one ``initialize_xfer`` + ``transfer`` of all spans: once with
  UCX's default transports (shared memory / CMA between local processes: not a network
  path) and once restricted to TCP (``UCX_TLS=tcp``), the like-for-like comparison.

Writes ``benchmarks/results/transport_bandwidth.json``. Run:
``.venv/bin/python benchmarks/transport_bandwidth.py`` (about 2-3 minutes).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np

LAYERS, KV_HEADS, HEAD_DIM, DTYPE_BYTES, BLOCK_TOKENS = 28, 4, 128, 2, 16
BLOCK_BYTES = BLOCK_TOKENS * KV_HEADS * HEAD_DIM * DTYPE_BYTES  # one K or V block of a layer
TOKEN_BYTES = LAYERS * 2 * KV_HEADS * HEAD_DIM * DTYPE_BYTES
RESULTS = Path(__file__).parent / "results" / "transport_bandwidth.json"
REPLY_TIMEOUT_S = 300.0
WAIT_S = 120.0
TCP_CHUNK = 4 << 20
#: Our transport's rows: name -> (backend, settings).
OURS: dict[str, tuple[str, dict[str, Any]]] = {
    "ours-mc": ("mooncake", {"host": "127.0.0.1", "protocol": "tcp"}),
    "ours-tcp": ("tcp", {"host": "127.0.0.1"}),
    "ours-cma": ("cma", {"host": "127.0.0.1"}),
}
#: Small transfers (label, spans of 16 KiB blocks or one span of bytes) whose latency is the
#: fixed cost of a transfer: (label, number of spans, bytes per span).
SMALL: list[tuple[str, int, int]] = [
    ("4 KiB, 1 span", 1, 4 << 10),
    ("64 KiB, 4 spans", 4, BLOCK_BYTES),
    ("1 MiB, 1 span", 1, 1 << 20),
    ("1 MiB, 64 spans", 64, BLOCK_BYTES),
]
#: Transfers per mover and round in the latency rows (their median is the round's figure).
SMALL_REPS = 50
#: NIXL variants: UCX_TLS for each (None = UCX default).
NIXL_TLS: dict[str, str | None] = {"nixl": None, "nixl-tcp": "tcp"}


def blocks_for(tokens: int) -> int:
    return -(-tokens // BLOCK_TOKENS)


def kv_cache(num_blocks: int, fill: int | None) -> np.ndarray:
    """The whole KV cache as one flat byte buffer (one registered region per side).

    Filled with a pseudo-random pattern unless ``fill`` is None (zeros).
    """
    nbytes = LAYERS * 2 * num_blocks * BLOCK_BYTES
    if fill is None:
        return np.zeros(nbytes, dtype=np.uint8)
    row = np.random.default_rng(fill).integers(0, 256, (1 << 20) + 13, dtype=np.uint8)
    return np.resize(row, nbytes)


def layout_spans(layout: str, src_ids, dst_ids, num_blocks: int) -> list[np.ndarray]:
    """Spans (offsets in the flat caches) in the groups a connector would submit them.

    ``per-layer``: vLLM's usual ``[layer][K|V][block]`` layout; one group (one write) per layer,
    one 16 KiB span per K or V block. ``cross-layer``: a ``[block][layer][K|V]`` layout (vLLM's
    cross-layer KV cache); one group, one span of a whole block (all layers, 896 KiB).
    """
    src_ids, dst_ids = np.asarray(src_ids, np.int64), np.asarray(dst_ids, np.int64)
    if layout.startswith("cross-layer"):
        block = LAYERS * 2 * BLOCK_BYTES
        return [np.stack([src_ids * block, dst_ids * block, np.full(len(src_ids), block)], axis=1)]
    groups = []
    for layer in range(LAYERS):
        parts = []
        for kv in (0, 1):
            base = (layer * 2 + kv) * num_blocks
            parts.append(
                np.stack(
                    [
                        (base + src_ids) * BLOCK_BYTES,
                        (base + dst_ids) * BLOCK_BYTES,
                        np.full(len(src_ids), BLOCK_BYTES),
                    ],
                    axis=1,
                )
            )
        groups.append(np.concatenate(parts))
    return groups


# ----------------------------------------------------------------- the decode side
def _nixl_agent(name: str, ucx_tls: str | None) -> Any:
    """A NIXL UCX agent; ``UCX_TLS`` is read when UCX starts, so set it around creation."""
    from nixl._api import nixl_agent, nixl_agent_config

    saved = os.environ.get("UCX_TLS")
    if ucx_tls:
        os.environ["UCX_TLS"] = ucx_tls
    else:
        os.environ.pop("UCX_TLS", None)
    try:
        return nixl_agent(name, nixl_agent_config(backends=["UCX"]))
    finally:
        if saved is None:
            os.environ.pop("UCX_TLS", None)
        else:
            os.environ["UCX_TLS"] = saved


def _decode_side(conn: Any, num_blocks: int, nixl_variants: list[str]) -> None:
    cache = kv_cache(num_blocks, fill=None)
    state: dict[str, Any] = {"variants": nixl_variants}
    try:
        while True:
            cmd, args = conn.recv()
            if cmd == "exit":
                conn.send(("ok", None))
                return
            try:
                conn.send(("ok", _decode_cmd(cmd, args, cache, state)))
            except Exception as e:
                conn.send(("err", f"{type(e).__name__}: {e}"))
    finally:
        for t in state.get("ours", {}).values():
            t.close()


def _decode_cmd(cmd: str, args: tuple, cache: np.ndarray, state: dict[str, Any]) -> Any:
    if cmd == "ranges":  # bytes of (offset, length) ranges, for verification
        return b"".join(cache[off : off + n].tobytes() for off, n in args[0])
    if cmd == "clear":
        cache.fill(0)
        return None
    if cmd == "up":  # our transports (args[0]) or the NIXL agents, over the same cache
        from vllm_pd_ext.transport import get_backend

        descriptors, state["ours"] = {}, {}
        for name in args[0]:
            backend, settings = OURS[name]
            t = get_backend(backend, **settings)
            t.register_buffer("kv", cache.ctypes.data, cache.nbytes)
            state["ours"][name] = t
            descriptors[name] = t.descriptor().to_bytes()
        metas = {}
        regs = [(cache.ctypes.data, cache.nbytes, 0, "")]
        for variant in state["variants"]:
            agent = _nixl_agent(f"decode-{variant}-{os.getpid()}", NIXL_TLS[variant])
            agent.register_memory(regs, "DRAM")
            state[variant] = agent
            metas[variant] = agent.get_agent_metadata()
        return descriptors, metas, cache.ctypes.data
    if cmd == "tcp_listen":
        srv = socket.create_server(("127.0.0.1", 0))
        state["srv"] = srv
        return srv.getsockname()[1]
    if cmd == "tcp_recv":  # receive args[0] bytes on the accepted socket, ack with one byte
        nbytes = args[0]
        if "sock" not in state:
            state["sock"], _ = state["srv"].accept()
        sock = state["sock"]
        view = cache.reshape(-1).data
        got = 0
        while got < nbytes:
            n = min(TCP_CHUNK, nbytes - got)
            off = got % (len(view) - TCP_CHUNK)
            k = sock.recv_into(view[off : off + n], n)
            if k == 0:
                raise ConnectionError("sender closed")
            got += k
        sock.sendall(b"\x06")
        return got
    raise ValueError(cmd)


class DecodeProcess:
    """The decode side: a spawned process owning the destination KV cache."""

    def __init__(self, num_blocks: int, nixl_variants: list[str]) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_decode_side, args=(child, num_blocks, nixl_variants))
        self.proc.start()
        child.close()

    def send(self, cmd: str, *args: Any) -> None:
        self._conn.send((cmd, args))

    def result(self, cmd: str) -> Any:
        if not self._conn.poll(REPLY_TIMEOUT_S):
            raise TimeoutError(f"decode side did not answer {cmd!r}")
        status, value = self._conn.recv()
        if status == "err":
            raise RuntimeError(f"decode side failed {cmd!r}: {value}")
        return value

    def call(self, cmd: str, *args: Any) -> Any:
        self.send(cmd, *args)
        return self.result(cmd)

    def stop(self) -> None:
        try:
            if self.proc.is_alive():
                self.call("exit")
        finally:
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(5)


# ------------------------------------------------------------------------ floors
def memcpy_seconds(src: np.ndarray, dst: np.ndarray) -> float:
    t0 = time.perf_counter()
    np.copyto(dst, src)
    return time.perf_counter() - t0


class TcpFloor:
    """One loopback TCP connection to the decode process; ``once`` times ``nbytes`` through it."""

    def __init__(self, decode: DecodeProcess, src: np.ndarray) -> None:
        self.decode = decode
        self.sock = socket.create_connection(("127.0.0.1", decode.call("tcp_listen")))
        self.view = src.reshape(-1).data

    def once(self, nbytes: int) -> float:
        self.decode.send("tcp_recv", nbytes)
        t0 = time.perf_counter()
        sent = 0
        while sent < nbytes:
            n = min(TCP_CHUNK, nbytes - sent)
            off = sent % (len(self.view) - TCP_CHUNK)
            self.sock.sendall(self.view[off : off + n])
            sent += n
        if self.sock.recv(1) != b"\x06":
            raise ConnectionError("no ack from the decode side")
        dt = time.perf_counter() - t0
        if self.decode.result("tcp_recv") != nbytes:
            raise ConnectionError("decode side received the wrong byte count")
        return dt

    def close(self) -> None:
        self.sock.close()


# -------------------------------------------------------------------- transfers
class Ours:
    """``vllm_pd_ext.transport`` (a backend of OURS): one batched write per group, wait_all."""

    def __init__(self, name: str, src: np.ndarray, descriptor: bytes) -> None:
        from vllm_pd_ext.transport import get_backend

        backend, settings = OURS[name]
        self.t = get_backend(backend, **settings)
        self.t.register_buffer("kv", src.ctypes.data, src.nbytes)
        self.peer = self.t.connect(descriptor)

    def once(self, groups: list[np.ndarray]) -> float:
        t0 = time.perf_counter()
        handles = [self.t.write(self.peer, "kv", "kv", spans) for spans in groups]
        self.t.wait_all(handles, WAIT_S)
        return time.perf_counter() - t0

    def close(self) -> None:
        self.t.close()


class Nixl:
    """NIXL UCX agent: one ``initialize_xfer`` + ``transfer`` of every span."""

    def __init__(self, variant: str, src: np.ndarray, meta: bytes, remote_base: int) -> None:
        self.agent = _nixl_agent(f"prefill-{variant}-{os.getpid()}", NIXL_TLS[variant])
        self.agent.register_memory([(src.ctypes.data, src.nbytes, 0, "")], "DRAM")
        self.peer = self.agent.add_remote_agent(meta)
        self.local_base = src.ctypes.data
        self.remote_base = remote_base

    def once(self, groups: list[np.ndarray]) -> float:
        a = self.agent
        t0 = time.perf_counter()
        spans = np.concatenate(groups)
        local = np.stack([spans[:, 0] + self.local_base, spans[:, 2], 0 * spans[:, 2]], axis=1)
        remote = np.stack([spans[:, 1] + self.remote_base, spans[:, 2], 0 * spans[:, 2]], axis=1)
        handle = a.initialize_xfer(
            "WRITE",
            a.get_xfer_descs(local, "DRAM"),
            a.get_xfer_descs(remote, "DRAM"),
            self.peer,
        )
        state = a.transfer(handle)
        deadline = time.monotonic() + WAIT_S
        while state not in ("DONE", "ERR") and time.monotonic() < deadline:
            state = a.check_xfer_state(handle)
        a.release_xfer_handle(handle)
        if state != "DONE":
            raise RuntimeError(f"NIXL transfer ended in state {state}")
        return time.perf_counter() - t0

    def close(self) -> None:
        self.agent.remove_remote_agent(self.peer)


def check_spans(decode: DecodeProcess, src: np.ndarray, groups: list[np.ndarray]) -> None:
    """Compare the bytes of 32 random spans on the decode side with their source."""
    spans = np.concatenate(groups)
    picks = spans[np.random.default_rng(len(spans)).integers(0, len(spans), 32)]
    got = decode.call("ranges", [(int(r), int(n)) for _, r, n in picks])
    want = b"".join(src[int(lo) : int(lo) + int(n)].tobytes() for lo, _, n in picks)
    if got != want:
        raise AssertionError("transferred KV blocks differ from the source")


# ------------------------------------------------------------------------- main
def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> str:
    try:
        return subprocess.run(
            ["git", "-C", str(Path(__file__).parent), *args],
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def make_plans(token_sizes: list[int], layouts: list[str], num_blocks: int) -> list[dict]:
    """One plan per (layout, prompt length): prefill blocks 0..n-1 to decode blocks."""
    plans = []
    for layout in layouts:
        rng = np.random.default_rng(0)
        for tokens in token_sizes:
            nb = blocks_for(tokens)
            src_ids = np.arange(nb)
            scattered = layout.endswith("scattered")
            dst_ids = rng.permutation(num_blocks)[:nb] if scattered else np.arange(nb)
            groups = layout_spans(layout, src_ids, dst_ids, num_blocks)
            plans.append(
                {
                    "layout": layout,
                    "tokens": tokens,
                    "groups": groups,
                    "bytes": sum(int(g[:, 2].sum()) for g in groups),
                    "spans": sum(len(g) for g in groups),
                }
            )
    return plans


def small_groups(spans: int, size: int, num_blocks: int) -> list[np.ndarray]:
    """One group: ``spans`` spans of ``size`` bytes from prefill block 0 on, to every other
    decode block of the first layer's K cache (scattered; one span: offset 0 both sides)."""
    src = np.arange(spans) * size
    dst = np.arange(spans) * 2 * BLOCK_BYTES if spans > 1 else np.zeros(1, np.int64)
    assert spans == 1 or 2 * spans <= num_blocks
    return [np.stack([src, dst, np.full(spans, size)], axis=1).astype(np.int64)]


def measure_small(
    args: argparse.Namespace,
    movers: dict[str, Any],
    src: np.ndarray,
    num_blocks: int,
    errors: dict[str, str],
) -> list[dict]:
    """Latency of small transfers: per round and mover, the median of ``SMALL_REPS``."""
    rows = []
    for label, spans, size in SMALL:
        groups = small_groups(spans, size, num_blocks)
        nbytes = spans * size
        row: dict[str, Any] = {"transfer": label, "bytes": nbytes, "spans": spans}
        row["runs_us"] = {name: [] for name in [*movers, "memcpy"]}
        a, b = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
        for _ in range(args.runs):
            row["runs_us"]["memcpy"].append(
                statistics.median(memcpy_seconds(a, b) for _ in range(SMALL_REPS)) * 1e6
            )
            for name, mover in list(movers.items()):
                try:
                    dts = [mover.once(groups) for _ in range(SMALL_REPS)]
                except Exception as e:
                    errors[name] = f"{type(e).__name__}: {e}"
                    del movers[name]
                    continue
                row["runs_us"][name].append(statistics.median(dts) * 1e6)
        rows.append(row)
        print(
            f"  {label:>21}: "
            + ", ".join(
                f"{k} {statistics.median(v):.0f} us" for k, v in row["runs_us"].items() if v
            ),
            flush=True,
        )
    return rows


def measure(
    args: argparse.Namespace, peers: list[str], ours: list[str]
) -> tuple[list[dict], list[dict], dict[str, str]]:
    """One phase: some of our transports, or the NIXL peers, next to the floors; then the
    latency rows (:func:`measure_small`).

    Phases keep the engines apart (NIXL's UCX progress threads must not share the host's cores
    with our engine's threads while we are measured, nor the reverse); within a phase the
    floors and each transport run in interleaved rounds.
    """
    token_sizes = [int(x) for x in args.tokens.split(",")]
    num_blocks = blocks_for(max(token_sizes))
    plans = make_plans(token_sizes, args.layouts.split(","), num_blocks)
    src = kv_cache(num_blocks, fill=1)
    floor_bytes = args.floor_mb << 20
    mc_src = np.ones(floor_bytes, dtype=np.uint8)
    mc_dst = np.empty_like(mc_src)
    errors: dict[str, str] = {}
    movers: dict[str, Any] = {}
    decode = DecodeProcess(num_blocks, peers)
    tcp = None
    try:
        descriptors, metas, remote_base = decode.call("up", ours)
        for name in ours:
            movers[name] = Ours(name, src, descriptors[name])
        for variant in peers:
            try:
                movers[variant] = Nixl(variant, src, metas[variant], remote_base)
            except Exception as e:  # a peer failing must not hide our numbers
                errors[variant] = f"{type(e).__name__}: {e}"
        tcp = TcpFloor(decode, src)
        tcp.once(floor_bytes)
        memcpy_seconds(mc_src, mc_dst)
        for m in movers.values():  # warm-up: connections, first-touch, registrations
            m.once(plans[0]["groups"])
        rows = []
        last_gbps: dict[tuple[str, str], float] = {}  # (layout, mover) -> at the last size
        for plan in plans:
            row = {k: plan[k] for k in ("layout", "tokens", "bytes", "spans")}
            row["runs"] = {name: [] for name in [*movers, "tcp", "memcpy"]}
            row["vs_tcp"] = {name: [] for name in movers}
            row["vs_memcpy"] = {name: [] for name in movers}
            row["skipped"] = {}
            spent = dict.fromkeys(movers, 0.0)
            for name in movers:  # a mover too slow at the last size would blow the budget here
                gbps = last_gbps.get((plan["layout"], name))
                if gbps and plan["bytes"] / (gbps * 1e9) > 2 * args.budget_s:
                    row["skipped"][name] = f"predicted {plan['bytes'] / (gbps * 1e9):.0f} s a run"
            for rnd in range(args.runs):
                tcp_gbps = floor_bytes / tcp.once(floor_bytes) / 1e9
                memcpy_gbps = floor_bytes / memcpy_seconds(mc_src, mc_dst) / 1e9
                row["runs"]["tcp"].append(tcp_gbps)
                row["runs"]["memcpy"].append(memcpy_gbps)
                for name, mover in list(movers.items()):
                    if name in row["skipped"] or (rnd and spent[name] > args.budget_s):
                        continue  # slow: fewer runs, recorded in the JSON
                    if rnd == 0:
                        decode.call("clear")
                    try:
                        dt = mover.once(plan["groups"])
                        if rnd == 0:
                            check_spans(decode, src, plan["groups"])
                    except Exception as e:
                        errors[name] = f"{type(e).__name__}: {e}"
                        del movers[name]
                        continue
                    spent[name] += dt
                    gbps = plan["bytes"] / dt / 1e9
                    row["runs"][name].append(gbps)
                    row["vs_tcp"][name].append(gbps / tcp_gbps)
                    row["vs_memcpy"][name].append(gbps / memcpy_gbps)
            for name in movers:
                if row["runs"][name]:
                    last_gbps[(plan["layout"], name)] = statistics.median(row["runs"][name])
            rows.append(row)
            print(
                f"  {row['layout']:>21} {row['tokens']:>6} tokens: "
                + ", ".join(f"{k} {statistics.median(v):.2f}" for k, v in row["runs"].items() if v),
                flush=True,
            )
        small = measure_small(args, movers, src, num_blocks, errors)
        return rows, small, errors
    finally:
        for m in movers.values():
            m.close()
        if tcp is not None:
            tcp.close()
        decode.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--tokens", default="1024,8192,32768", help="prompt lengths, comma-separated")
    ap.add_argument(
        "--layouts",
        default="per-layer-contiguous,per-layer-scattered,cross-layer-scattered",
        help="cache layouts and decode block placement",
    )
    ap.add_argument("--runs", type=int, default=3, help="timed rounds per configuration")
    ap.add_argument("--budget-s", type=float, default=10.0, help="stop re-running a slow one")
    ap.add_argument("--floor-mb", type=int, default=256, help="MiB per floor measurement")
    ap.add_argument("--ours", default=",".join(OURS), help="our backends' rows, one phase each")
    ap.add_argument("--peers", default="nixl,nixl-tcp", help="NIXL variants ('' = none)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    peers = [p for p in args.peers.split(",") if p]
    unknown = set(peers) - set(NIXL_TLS)
    if unknown:
        ap.error(f"unknown peers: {sorted(unknown)}")
    ours = [o for o in args.ours.split(",") if o]
    if set(ours) - set(OURS):
        ap.error(f"unknown --ours: {sorted(set(ours) - set(OURS))}")

    t_start = time.perf_counter()
    load_start = os.getloadavg()
    print(f"machine: {os.cpu_count()} cores, {_cpu_model()}; load {load_start[0]:.1f}")
    phases = [([], [name]) for name in ours] + ([(peers, [])] if peers else [])
    rows: list[dict] = []
    small: list[dict] = []
    errors: dict[str, str] = {}
    for phase_peers, phase_ours in phases:
        phase_rows, phase_small, phase_errors = measure(args, phase_peers, phase_ours)
        errors.update(phase_errors)
        if not rows:
            rows, small = phase_rows, phase_small
            continue
        for row, extra in zip(rows, phase_rows, strict=True):
            for name, runs in extra["runs"].items():
                row["runs"].setdefault(name, []).extend(runs)
            row["vs_tcp"].update(extra["vs_tcp"])
            row["vs_memcpy"].update(extra["vs_memcpy"])
            row["skipped"].update(extra["skipped"])
        for row, extra in zip(small, phase_small, strict=True):
            for name, runs in extra["runs_us"].items():
                row["runs_us"].setdefault(name, []).extend(runs)
    elapsed = time.perf_counter() - t_start
    med = statistics.median

    names = [n for n in [*ours, *peers] if n not in errors]
    print(f"\nGB/s, median of up to {args.runs} rounds; x/tcp: median ratio to the TCP floor")
    print("measured in the same round (phases ran at different machine loads: compare ratios)")
    print(
        "ours-mc / ours-tcp / ours-cma = vllm_pd_ext.transport, 'mooncake' backend over TCP / "
        "'tcp' / 'cma' backend; floors: memcpy, TCP loopback"
    )
    head = f"{'layout':>21} {'tokens':>6} {'MB':>6} {'spans':>7} {'memcpy':>6} {'tcp':>5}"
    head += "".join(f" {n:>8}" for n in names) + "".join(f" {n + '/tcp':>12}" for n in names)
    print(head)
    for r in rows:
        runs = r["runs"]
        r["median_gbps"] = {k: med(v) for k, v in runs.items() if v}
        r["median_vs_tcp"] = {k: med(v) for k, v in r["vs_tcp"].items() if v}
        r["median_vs_memcpy"] = {k: med(v) for k, v in r["vs_memcpy"].items() if v}
        r["ours_vs_tcp"] = {n: r["median_vs_tcp"][n] for n in ours if n in r["median_vs_tcp"]}
        line = (
            f"{r['layout']:>21} {r['tokens']:>6} {r['bytes'] / 1e6:>6.0f} {r['spans']:>7} "
            f"{med(runs['memcpy']):>6.2f} {med(runs['tcp']):>5.2f}"
        )
        line += "".join(
            f" {r['median_gbps'][n]:>8.2f}" if n in r["median_gbps"] else f" {'-':>8}"
            for n in names
        )
        line += "".join(
            f" {r['median_vs_tcp'][n]:>12.0%}" if n in r["median_vs_tcp"] else f" {'-':>12}"
            for n in names
        )
        print(line)
    cma = "ours-cma"
    if cma in names:
        print(
            f"\n{cma}: x/memcpy, x/tcp and the same ratios of nixl (NIXL's own phase and rounds); "
            "vs nixl: the ratio of the two x/memcpy (each against the memcpy of its own rounds, "
            "so the phases' different loads cancel), and of the two x/tcp"
        )
        print(
            f"{'layout':>21} {'tokens':>6} {'memcpy':>6} {'tcp':>7} {'nixl:':>6} {'tcp':>7}"
            f" {'vs nixl':>7} {'(tcp)':>7}"
        )
        for r in rows:
            mc, tc = r["median_vs_memcpy"], r["median_vs_tcp"]
            both = cma in mc and "nixl" in mc
            r["cma_vs_nixl"] = (
                {"by_memcpy": mc[cma] / mc["nixl"], "by_tcp": tc[cma] / tc["nixl"]}
                if both
                else None
            )
            line = f"{r['layout']:>21} {r['tokens']:>6}"
            line += f" {mc.get(cma, float('nan')):>6.0%} {tc.get(cma, float('nan')):>7.0%}"
            line += f" {mc.get('nixl', float('nan')):>6.0%} {tc.get('nixl', float('nan')):>7.0%}"
            if both:
                v = r["cma_vs_nixl"]
                line += f" {v['by_memcpy']:>6.2f}x {v['by_tcp']:>6.2f}x"
            print(line)
    print(f"\nmicroseconds per small transfer, median of {args.runs} rounds of {SMALL_REPS}")
    snames = ["memcpy", *names]
    print(f"{'transfer':>21}" + "".join(f" {n:>9}" for n in snames))
    for r in small:
        r["median_us"] = {k: med(v) for k, v in r["runs_us"].items() if v}
        print(
            f"{r['transfer']:>21}"
            + "".join(
                f" {r['median_us'][n]:>9.0f}" if n in r["median_us"] else f" {'-':>9}"
                for n in snames
            )
        )
    for name, err in errors.items():
        print(f"{name}: failed: {err}")
    print(f"total {elapsed:.0f} s")

    report = {
        "benchmark": "transport_bandwidth",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "git_commit": _git("rev-parse", "--short", "HEAD"),
        "uncommitted_in_vllm_pd_ext": _git(
            "status", "--porcelain", "--", "../vllm_pd_ext"
        ).splitlines(),
        "machine": {
            "cpus": os.cpu_count(),
            "cpu_model": _cpu_model(),
            "python": platform.python_version(),
            "load_average_at_start": load_start,
            "load_average_at_end": os.getloadavg(),
            "note": "shared machine: other jobs ran during the measurement",
        },
        "versions": {
            "mooncake": _version("mooncake-transfer-engine-non-cuda")
            or _version("mooncake-transfer-engine"),
            "nixl": _version("nixl"),
            "numpy": np.__version__,
        },
        "model_shape": {
            "layers": LAYERS,
            "kv_heads": KV_HEADS,
            "head_dim": HEAD_DIM,
            "dtype": "bfloat16",
            "block_tokens": BLOCK_TOKENS,
            "block_bytes": BLOCK_BYTES,
            "bytes_per_token": TOKEN_BYTES,
        },
        "settings": {
            "runs": args.runs,
            "budget_s": args.budget_s,
            "floor_mb": args.floor_mb,
            "layouts": {
                "per-layer-contiguous": "[layer][K|V][block] caches, decode blocks 0..n-1 "
                "(fresh engine): spans coalesce into one K and one V run per layer",
                "per-layer-scattered": "[layer][K|V][block] caches, random decode blocks: "
                "one 16 KiB span per K or V block per layer",
                "cross-layer-scattered": "[block][layer][K|V] cache (vLLM cross-layer "
                "layout), random decode blocks: one 896 KiB span per block",
            },
        },
        "transports": {
            "ours-mc": "vllm_pd_ext.transport mooncake backend, protocol tcp, 127.0.0.1",
            "ours-tcp": "vllm_pd_ext.transport tcp backend (own data path: sendmsg/recvmsg_into "
            "between the registered caches over one socket), 127.0.0.1",
            "ours-cma": "vllm_pd_ext.transport cma backend (tcp's control path over a Unix "
            "socket, payloads by process_vm_readv/writev between the registered caches)",
            "nixl": "NIXL UCX backend, UCX default transports (shm/CMA between local processes)",
            "nixl-tcp": "NIXL UCX backend with UCX_TLS=tcp",
            "tcp": "one Python socket, 4 MiB sendall/recv_into (floor)",
            "memcpy": "numpy.copyto in one process (floor)",
        },
        "errors": errors,
        "results": rows,
        "small_transfers": small,
        "goal": "ours >= 50% of the TCP loopback floor in every layout; ours-cma >= nixl "
        "(UCX defaults) in every layout, >= 70% of memcpy, and <= 1 ms per transfer up to "
        "1 MiB",
        "elapsed_s": elapsed,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
