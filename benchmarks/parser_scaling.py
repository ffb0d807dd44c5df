"""How long tool-call extraction takes on hostile model output, ours against vLLM's patterns.

vLLM's ``deepseek_v3`` pattern backtracks in time cubic in the length of a line full of its
markers, and its pre-v11 Mistral array pattern (``\\[{.*}\\]``) quadratic in the length of a
body full of ``[{``; a model (or a client steering one) that emits such output stalls a
render worker. Ours (``deepseek_v3_calls``, ``first_array`` in vllm_pd_ext/render_server/
parsers/) scan once. For each size, both run on the same input, alternating, ``--rounds``
times; vLLM's stops growing once one run passes ``--vllm-limit-s``. The results, every round,
go to ``--out`` as JSON with the date and commit.

    .venv/bin/python benchmarks/parser_scaling.py
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm_pd_ext.render_server.parsers.buffered import DS_CALL_BEGIN, DS_SEP, deepseek_v3_calls
from vllm_pd_ext.render_server.parsers.mistral import first_array
from vllm_pd_ext.testing.vllm_patterns import deepseek_v3_pattern, mistral_array_pattern

REPO = Path(__file__).resolve().parent.parent


def _timed(fn: Callable[[str], object], text: str) -> float:
    t0 = time.perf_counter()
    fn(text)
    return time.perf_counter() - t0


def _case(
    name: str,
    unit: str,
    ours: Callable[[str], object],
    theirs: Callable[[str], object],
    sizes: list[int],
    rounds: int,
    limit_s: float,
    power: int,
) -> dict[str, Any]:
    """``power``: how vLLM's time grows with the length (3: cubic), to stop it before a size
    whose estimate passes ``limit_s``."""
    rows = []
    vllm_on = True
    last: tuple[int, float] | None = None
    for n in sizes:
        text = unit * max(1, n // len(unit))
        if vllm_on and last is not None and last[1] * (len(text) / last[0]) ** power > limit_s:
            vllm_on = False
        row: dict[str, Any] = {"chars": len(text), "ours_s": [], "vllm_s": []}
        for _ in range(rounds):
            row["ours_s"].append(_timed(ours, text))
            if vllm_on:
                row["vllm_s"].append(_timed(theirs, text))
        if row["vllm_s"]:
            last = (len(text), max(row["vllm_s"]))
        rows.append(row)
        print(
            f"{name} {len(text):>8} chars: ours {min(row['ours_s']) * 1e3:8.2f} ms"
            + (f", vLLM {min(row['vllm_s']) * 1e3:10.1f} ms" if row["vllm_s"] else "")
        )
    return {"input": f"{unit!r} repeated", "vllm_growth_power": power, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--vllm-limit-s", type=float, default=5.0)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks/results/parser_scaling.json")
    args = p.parse_args(argv)

    deepseek, mistral = deepseek_v3_pattern(), mistral_array_pattern()
    sizes = [1000, 2000, 4000, 6200, 9300, 20000, 100000, 1000000]
    cases = {
        "deepseek_v3": _case(
            "deepseek_v3",
            DS_CALL_BEGIN + DS_SEP,
            deepseek_v3_calls,
            lambda t: list(deepseek.finditer(t)),
            sizes,
            args.rounds,
            args.vllm_limit_s,
            3,
        ),
        "deepseek_v3_lines": _case(
            "deepseek_v3_lines",
            (DS_CALL_BEGIN + DS_SEP) * 40 + "\n",
            deepseek_v3_calls,
            lambda t: list(deepseek.finditer(t)),
            sizes,
            args.rounds,
            args.vllm_limit_s,
            1,
        ),
        "mistral_array": _case(
            "mistral_array",
            "[{",
            first_array,
            lambda t: mistral.findall(t),
            [*sizes, 4000000],
            args.rounds,
            args.vllm_limit_s,
            2,
        ),
    }
    commit = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": commit,
        "python": platform.python_version(),
        "rounds": args.rounds,
        "vllm_limit_s": args.vllm_limit_s,
        "cases": cases,
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
