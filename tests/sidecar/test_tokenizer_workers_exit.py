"""The sidecar's tokenizer worker processes go when the sidecar goes, however it goes.

A worker holds its own end of the pool's job queue, so without a check of its own it
outlives a sidecar killed outright (SIGKILL, the OOM killer), and keeps the resource
tracker running too: a restarted container would pile them up.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from .helpers import wait_for

REPO = Path(__file__).resolve().parents[2]

SIDECAR_LIKE = textwrap.dedent("""
    import multiprocessing, sys, time
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from engine_sidecar.gateway.token_pool import TokenizerPool

    if __name__ == "__main__":
        tokenizer = Tokenizer(WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
        pool = TokenizerPool(tokenizer.to_str(), workers=2)
        pool.start()
        print(" ".join(str(p.pid) for p in multiprocessing.active_children()), flush=True)
        time.sleep(600)
""")


def _running(pid: int) -> bool:
    """Alive and not a zombie waiting for its new parent to reap it."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_workers_exit_when_the_sidecar_is_killed_outright(tmp_path: Path) -> None:
    script = tmp_path / "sidecar_like.py"
    script.write_text(SIDECAR_LIKE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get(
        "PYTHONPATH", "")])}
    sidecar = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                               env=env, text=True)
    try:
        assert sidecar.stdout is not None
        workers = [int(pid) for pid in sidecar.stdout.readline().split()]
        assert len(workers) >= 2 and all(_running(pid) for pid in workers)
    finally:
        sidecar.send_signal(signal.SIGKILL)
        sidecar.wait()
    # Generous: a worker checks every PARENT_CHECK_S (1 s); this bounds a stuck worker,
    # not the machine's speed.
    try:
        wait_for(lambda: not any(_running(pid) for pid in workers), 60,
                 "tokenizer workers outlived the sidecar")
    finally:
        for pid in workers:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
