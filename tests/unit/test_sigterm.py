"""SIGTERM to a member process: `draining()` turns true at once, the process keeps serving,
and it exits by itself after the timeout when nobody stops it first."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

PROGRAM = """
import sys, time
from services.common import sigterm
assert sigterm.drain_on_sigterm(float(sys.argv[1]), "test-member")
print("ready", sigterm.draining(), flush=True)
while not sigterm.draining():
    time.sleep(0.01)
print("draining", flush=True)
for i in range(1000):          # still serving after SIGTERM
    print("tick", i, flush=True)
    time.sleep(0.05)
"""


def test_sigterm_drains_then_exits_after_the_timeout():
    proc = subprocess.Popen([sys.executable, "-c", PROGRAM, "1.0"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().split() == ["ready", "False"]
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.stdout.readline().strip() == "draining"
        assert proc.stdout.readline().startswith("tick 0")      # it did not stop serving
        assert proc.wait(timeout=30) == 0
        assert time.monotonic() - start >= 1.0                  # not before the timeout
        ticks = [line for line in proc.stdout.read().splitlines() if line.startswith("tick")]
        assert len(ticks) >= 3 and "exiting" in proc.stderr.read()
    finally:
        proc.kill()
