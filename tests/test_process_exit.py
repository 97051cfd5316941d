"""``gcomp.end_process``: the output flushed, the code kept, the interpreter's shutdown skipped."""
from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import atexit, sys, gcomp
atexit.register(lambda: print("atexit ran"))
sys.stdout.write("unflushed line without a newline")
gcomp.end_process(3)
print("never printed")
"""


def test_end_process_flushes_keeps_the_code_and_skips_shutdown():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr
    assert done.stdout == "unflushed line without a newline"  # flushed; neither atexit nor the next line ran
