"""The remote tier's batched read, with and without a registered staging buffer, on a real
Mooncake Store: a ``mooncake_master`` on 127.0.0.1 and one store client in this process.

``--blocks`` objects of ``--block-kib`` KiB each, rounds interleaved, medians printed:

* raw store calls: ``get_batch`` (one Python ``bytes`` per object) and a copy of each into its
  block, against ``batch_get_into`` into a registered buffer and the same copy; and, for
  writes, one ``upsert_parts`` per object against one ``batch_put_from`` of a registered buffer
  (to new names: on a name that exists it keeps the old object);
* through :class:`~vllm_pd_ext.connectors.flexkv.remote.MooncakeBlockStore` with a fleet key
  (header, keyed MAC and checks included): ``fetch_many`` + ``check_into`` against
  ``fetching`` + ``check_into``.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/flexkv_remote_registered.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np

from vllm_pd_ext.connectors.flexkv.config import RemoteTierConfig
from vllm_pd_ext.connectors.flexkv.remote import MooncakeBlockStore
from vllm_pd_ext.util.mooncake_master import mooncake_master


def _report(name: str, seconds: list[float], nbytes: int) -> None:
    med = statistics.median(seconds)
    print(f"{name:36s} median {med * 1e3:7.2f} ms  {nbytes / med / 1e9:5.2f} GB/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--block-kib", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    n, size = args.blocks, args.block_kib * 1024
    with mooncake_master() as m:
        cfg = RemoteTierConfig(master=m.master, segment_gb=0.25, buffer_mb=64)
        blocks = MooncakeBlockStore(cfg, "bench", key=b"k" * 32)
        raw = blocks._store  # the same client, for the raw calls
        rng = np.random.default_rng(0)
        data = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(n)]
        names = [f"raw/{i}" for i in range(n)]
        for name, d in zip(names, data, strict=True):
            assert raw.upsert_parts(name, d) == 0
        stage = np.empty(n * size, dtype=np.uint8)
        assert raw.register_buffer(stage.ctypes.data, stage.nbytes) == 0
        ptrs = [stage.ctypes.data + i * size for i in range(n)]
        out = np.empty((n, size), dtype=np.uint8)
        keys = [f"{i:032x}" for i in range(n)]
        for k, d in zip(keys, data, strict=True):
            blocks.write(k, d, "fp")
        rows = [bytearray(size) for _ in keys]

        def get_batch() -> None:
            for i, b in enumerate(raw.get_batch(names)):
                out[i] = np.frombuffer(b, np.uint8)

        def get_into() -> None:
            assert all(x == size for x in raw.batch_get_into(names, ptrs, [size] * n))
            out[:] = stage.reshape(n, size)

        def upserts() -> None:
            for name, d in zip(names, data, strict=True):
                raw.upsert_parts(name, d)

        def put_from(r: int) -> None:
            stage[:] = out.reshape(-1)
            fresh = [f"new/{r}/{i}" for i in range(n)]
            assert all(x == 0 for x in raw.batch_put_from(fresh, ptrs, [size] * n))

        def fetch_many() -> None:
            got = blocks.fetch_many(keys)
            for k, row in zip(keys, rows, strict=True):
                blocks.check_into(k, got[k], row, "fp")

        def fetching() -> None:
            with blocks.fetching(dict.fromkeys(keys, size)) as got:
                for k, row in zip(keys, rows, strict=True):
                    blocks.check_into(k, got[k], row, "fp")

        cases: dict[str, Callable[[int], None]] = {
            "get_batch + copy": lambda r: get_batch(),
            "batch_get_into (registered) + copy": lambda r: get_into(),
            f"upsert_parts x{n}": lambda r: upserts(),
            "copy + batch_put_from (registered)": put_from,
            "fetch_many + check_into": lambda r: fetch_many(),
            "fetching (registered) + check_into": lambda r: fetching(),
        }
        seconds: dict[str, list[float]] = {name: [] for name in cases}
        for r in range(args.rounds):
            for name, case in cases.items():
                t0 = time.perf_counter()
                case(r)
                seconds[name].append(time.perf_counter() - t0)
        assert blocks.staged_reads == args.rounds * n, "the registered path was not taken"
        assert all(bytes(row) == d for row, d in zip(rows, data, strict=True))
        print(f"{n} blocks of {args.block_kib} KiB, {args.rounds} rounds, interleaved")
        for name, s in seconds.items():
            _report(name, s, n * size)
        raw.unregister_buffer(stage.ctypes.data)
        blocks.close()


if __name__ == "__main__":
    main()
