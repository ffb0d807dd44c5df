"""Fixtures of the util tests: a process group with threads and a child that poll."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# A process with one thread polling without pause, one waiting, and a child process polling;
# it prints the thread ids, then runs until killed.
SCRIPT = r"""
import json, os, subprocess, sys, threading
def spin():
    while True:
        pass
def wait():
    threading.Event().wait()
ids = {}
for name, target in (("spinner", spin), ("waiter", wait)):
    t = threading.Thread(target=target, daemon=True)
    t.start()
    ids[name] = t.native_id
child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
ids["child"] = child.pid
print(json.dumps(ids), flush=True)
threading.Event().wait()
"""


@pytest.fixture
def group():
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert proc.stdout is not None
        yield proc.pid, json.loads(proc.stdout.readline())
    finally:
        os.killpg(proc.pid, 9)
        proc.wait(timeout=10)
