"""What the fleet key costs: signing at the proxy, checking at the decode engine, a tagged
side-channel request, the ``tcp`` backend's keyed HELLO and its grant check, a tagged MoRI
"written" notice, and the FlexKV block files' keyed MAC, set against one READ of a long
prompt's KV.

A keyed READ split pays, beyond an unkeyed one: the prefill's signature and the decode's check
of the params (once each), a tagged ``/renew`` round trip instead of a plain one (the decode
worker renews right before it reads), and, on the ``tcp`` backend, the grant of the leased
blocks to the reader, the server's check of the spans it is asked for, and the revoke (all
summed as ``keyed_read_split_extra_ms``; the check also runs inside the keyed reads, which
``keyed_read_vs_plain_read_pct`` compares with plain ones: loopback reads on a busy host vary
far more than that check costs, so it is timed alone too).
A keyed WRITE split pays the proxy's signature, the decode's check, and a tagged "written"
notice instead of a plain one. The handshake and the ``tcp`` HELLO are paid once per peer (a
proof each way, one more round trip), not per transfer. The goals: under 0.2 ms per request
at the proxy, under 2% of the transfer time at 8k tokens.

A FlexKV restore with a key checks a keyed BLAKE3 MAC over each block file instead of an
xxh3-64 checksum: measured on the same 8k tokens written as block files (page-cached: the
hashing, not the disk) and read back.

Each round measures every case with and without a key, alternating, in this one process: the
side channel and notify server are our real servers on loopback, the transfer two real ``tcp``
transports on loopback moving ``--tokens`` x ``--bytes-per-token`` (default 12 KiB:
Qwen2.5-0.5B's KV per token in bf16) as 16-token blocks of one region. Every round goes to
``--out`` as JSON with the date and commit.

    .venv/bin/python benchmarks/fleet_key_cost.py
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import secrets
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from vllm_pd_ext import fleet_key
from vllm_pd_ext.connectors.common.side_channel import SideChannelServer, post_json
from vllm_pd_ext.connectors.flexkv.store import FileStore
from vllm_pd_ext.transfer_params import PdExtReadAnswer, PdExtWriteDecode
from vllm_pd_ext.transport import get_backend
from vllm_pd_ext.transport.grants import GrantTable, merge_extents
from vllm_pd_ext.transport.notify import NotifyServer, send_notification

REPO = Path(__file__).resolve().parent.parent
BLOCK_TOKENS = 16
#: An 8k-token READ answer as our prefill engine signs it.
READ_ANSWER = PdExtReadAnswer(
    remote_engine_id="engine-" + "0" * 32,
    remote_request_id="cmpl-" + "0" * 32 + "-0",
    remote_host="10.0.0.12",
    remote_port=20500,
    remote_block_ids=[list(range(512))],
    remote_num_tokens=8191,
    prompt_hash="0" * 64,
    tp_size=1,
    lease_s=30.0,
    expires_at=time.time() + 3600,
)


def _sign_write(key: bytes) -> dict:
    """What the proxy does per pdext-write request: build the decode leg's params, sign."""
    return PdExtWriteDecode.build("0" * 32, None, "10.0.0.12", 20500).signed(key)


def _per_call_ms(fn: Callable[[], object], calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return 1e3 * (time.perf_counter() - t0) / calls


def _connect_ms(key: bytes | None, server_desc, calls: int) -> float:
    """A fresh transport connecting (HELLO) to the server ``calls`` times, per connection."""
    total = 0.0
    for _ in range(calls):
        client = get_backend("tcp", host="127.0.0.1", key=key)
        try:
            t0 = time.perf_counter()
            client.connect(server_desc)
            total += time.perf_counter() - t0
        finally:
            client.close()
    return 1e3 * total / calls


def _restore_ms(store: FileStore, keys: list[str], out: np.ndarray, block_bytes: int) -> float:
    """Read (and check) every block file of one prompt back into ``out``."""
    t0 = time.perf_counter()
    for i, k in enumerate(keys):
        store.read_into(k, out[i * block_bytes : (i + 1) * block_bytes], "bench")
    return 1e3 * (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--bytes-per-token", type=int, default=12288)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks/results/fleet_key_cost.json")
    args = p.parse_args(argv)

    key = secrets.token_bytes(fleet_key.MIN_KEY_BYTES)
    signed = READ_ANSWER.signed(key)
    signed_write = _sign_write(key)
    servers = {
        k: SideChannelServer("127.0.0.1", 0, dict, {"/renew": lambda body: None}, key=k)
        for k in (None, key)
    }
    block_bytes = BLOCK_TOKENS * args.bytes_per_token
    blocks = -(-args.tokens // BLOCK_TOKENS)
    size = blocks * block_bytes
    src, dst = np.ones(size, dtype=np.uint8), np.zeros(size, dtype=np.uint8)
    pairs: dict[bytes | None, Any] = {}
    for k in (None, key):
        a, b = (
            get_backend("tcp", host="127.0.0.1", key=k),
            get_backend("tcp", host="127.0.0.1", key=k),
        )
        a.register_buffer("kv", dst.ctypes.data, dst.nbytes, owner=dst)
        b.register_buffer("kv", src.ctypes.data, src.nbytes, owner=src)
        if k is not None:
            b.enforce_grants()  # as our connectors do with a key: a read needs a grant
        pairs[k] = (a, a.connect(b.descriptor()), b)
    notifiers = {k: NotifyServer("127.0.0.1", 0, key=k) for k in (None, key)}
    # a prompt's blocks are not in order in a real cache: here block i reads block n-1-i
    spans = [(i * block_bytes, (blocks - 1 - i) * block_bytes, block_bytes) for i in range(blocks)]
    leased = {"kv": [(src_off, length) for _, src_off, length in spans]}
    # what the tcp server checks a READ's spans with (inside read_ms_keyed, timed alone here)
    table = GrantTable(16)
    table.add("lease", "read", "d", {"kv": merge_extents(leased["kv"], size)})
    asked = np.asarray(leased["kv"], dtype=np.int64)
    files = tempfile.TemporaryDirectory(prefix="fleet-key-cost-")
    stores = {
        k: FileStore(files.name, "plain" if k is None else "keyed", key=k) for k in (None, key)
    }
    block_keys = [f"{i:032x}" for i in range(blocks)]  # 16-byte keys, as FlexKV names blocks
    for store in stores.values():
        for i, bk in enumerate(block_keys):
            store.write(bk, src[i * block_bytes : (i + 1) * block_bytes], "bench")
    rounds: list[dict[str, float]] = []
    try:
        for r in range(args.rounds):
            row: dict[str, float] = {}
            cases = [("plain", None), ("keyed", key)]
            for label, k in cases if r % 2 == 0 else cases[::-1]:  # each goes first by turns

                def renew(k: bytes | None = k) -> None:
                    post_json("127.0.0.1", servers[k].port, "/renew", {"req": "r"}, 5.0, k)

                row[f"renew_ms_{label}"] = statistics.median(
                    _per_call_ms(renew, 20) for _ in range(5)
                )
                a, peer, b = pairs[k]
                reads, grants = [], []
                for j in range(3):
                    t0 = time.perf_counter()
                    if k is not None:  # the prefill grants the reader the leased blocks
                        b.grant(f"lease-{r}-{j}", "read", a.engine_id, leased)
                    t1 = time.perf_counter()
                    a.wait(a.read(peer, "kv", "kv", spans), 60.0)
                    t2 = time.perf_counter()
                    if k is not None:
                        b.revoke(f"lease-{r}-{j}")
                    grants.append((t1 - t0) + (time.perf_counter() - t2))
                    reads.append(t2 - t1)
                row[f"read_ms_{label}"] = 1e3 * statistics.median(reads)
                if k is not None:
                    row["grant_revoke_ms"] = 1e3 * statistics.median(grants)
                row[f"hello_ms_{label}"] = _connect_ms(k, b.descriptor(), 10)

                def notify(k: bytes | None = k) -> None:
                    send_notification(notifiers[k].address, "engine-p", b"written" * 8, 5.0, k)

                row[f"notify_ms_{label}"] = statistics.median(
                    _per_call_ms(notify, 20) for _ in range(5)
                )
                notifiers[k].drain()
                row[f"restore_ms_{label}"] = _restore_ms(stores[k], block_keys, dst, block_bytes)
            row["grant_check_ms"] = _per_call_ms(
                lambda: table.allows("d", "read", "kv", asked), 200
            )
            row["sign_read_ms"] = _per_call_ms(lambda: READ_ANSWER.signed(key), 2000)
            row["verify_read_ms"] = _per_call_ms(
                lambda: PdExtReadAnswer.check(signed, key, time.time()), 2000
            )
            row["sign_write_ms"] = _per_call_ms(lambda: _sign_write(key), 2000)
            row["verify_write_ms"] = _per_call_ms(
                lambda: PdExtWriteDecode.check(signed_write, key, time.time()), 2000
            )
            rounds.append(row)
            print(f"round {r + 1}: " + ", ".join(f"{k} {v:.4f}" for k, v in row.items()))
    finally:
        for a, _, b in pairs.values():
            a.close()
            b.close()
        for server in servers.values():
            server.close()
        for notifier in notifiers.values():
            notifier.close()
        files.cleanup()
    med = {k: statistics.median(row[k] for row in rounds) for k in rounds[0]}
    # per transfer, beside the read itself (whose span checks are in read_ms_keyed)
    read_extra_ms = (
        med["renew_ms_keyed"]
        - med["renew_ms_plain"]
        + med["sign_read_ms"]
        + med["verify_read_ms"]
        + med["grant_revoke_ms"]
        + med["grant_check_ms"]
    )
    write_extra_ms = (
        med["sign_write_ms"]
        + med["verify_write_ms"]
        + med["notify_ms_keyed"]
        - med["notify_ms_plain"]
    )
    summary = {
        "medians_ms": med,
        "kv_bytes": size,
        "keyed_read_split_extra_ms": read_extra_ms,
        "keyed_read_split_extra_pct_of_read": 100 * read_extra_ms / med["read_ms_plain"],
        "keyed_read_vs_plain_read_pct": 100
        * (med["read_ms_keyed"] - med["read_ms_plain"])
        / med["read_ms_plain"],
        "keyed_write_split_extra_ms": write_extra_ms,
        "keyed_write_split_extra_pct_of_transfer": 100 * write_extra_ms / med["read_ms_plain"],
        "proxy_sign_ms_per_request": med["sign_write_ms"],
        "hello_extra_ms_per_peer": med["hello_ms_keyed"] - med["hello_ms_plain"],
        "flexkv_restore_mac_extra_ms": med["restore_ms_keyed"] - med["restore_ms_plain"],
        "flexkv_restore_mac_extra_pct": 100
        * (med["restore_ms_keyed"] - med["restore_ms_plain"])
        / med["restore_ms_plain"],
    }
    print(json.dumps(summary, indent=2))
    commit = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": commit,
        "machine": {
            "arch": platform.machine(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_average_at_end": list(os.getloadavg()),
        },
        "tokens": args.tokens,
        "bytes_per_token": args.bytes_per_token,
        "rounds": rounds,
        "summary": summary,
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
