"""Stand-ins for vLLM engines that the tests, the benchmarks and users' own tests share.

Shipped with the package (not under ``tests/``) because the benchmarks use them too and must not
import tests; they need nothing beyond the package's own requirements (FastAPI, uvicorn, httpx).
"""
