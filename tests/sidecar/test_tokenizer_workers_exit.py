"""The sidecar's tokenizer worker processes go when the sidecar goes, however it goes.

A sidecar that shuts down stops the workers it started with it.

A worker holds its own end of the pool's job queue, so without a check of its own it
outlives a sidecar killed outright (SIGKILL, the OOM killer), and keeps the resource
tracker running too: a restarted container would pile them up.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from engine_sidecar.gateway.app import GatewayConfig

from .conftest import start_harness
from .helpers import Keys, ServerThread, wait_for
from .stub_engine import StubEngine

REPO = Path(__file__).resolve().parents[2]

SIDECAR_LIKE = textwrap.dedent("""
    import multiprocessing, sys, time
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from engine_sidecar.gateway.counting.token_pool import TokenizerPool

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


def test_a_sidecar_that_shuts_down_stops_the_workers_it_started(
    tiny_model: Path, keys: Keys, tmp_path: Path
) -> None:
    # In-process: this test's process outlives the sidecar, so nothing but the shutdown
    # itself can stop the workers (their parent check would wait for pytest to exit).
    before = {p.pid for p in multiprocessing.active_children()}
    with ServerThread(StubEngine(model_id=str(tiny_model))).running() as engine:
        config = GatewayConfig(upstream=engine.url, secrets_dir=keys.dir,
                               plugin_policy_path=tmp_path / "plugin-policy.json",
                               tokenizer=str(tiny_model), engine_probe_interval=0.2)
        harness = start_harness(tmp_path, config, None)
        try:
            wait_for(lambda: harness.gateway.token_counter is not None, 120,
                     "the sidecar never loaded its tokenizer")
            workers = [p.pid for p in multiprocessing.active_children()
                       if p.pid not in before]
            assert workers and all(_running(pid) for pid in workers)
        finally:
            harness.stop()
    # The pool's shutdown signals its workers and returns; they exit within moments.
    wait_for(lambda: not any(_running(pid) for pid in workers), 30,
             f"tokenizer workers {workers} outlived the sidecar's shutdown")
