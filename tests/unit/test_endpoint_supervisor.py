"""The local endpoint's worker supervisor with stand-in workers (no engine): once a worker has
exited, on its own or stopped, its process group is empty and its working directory is gone."""

from __future__ import annotations

import asyncio
import os
import sys
import time

import endpoint.__main__ as main
from conftest import wait_for
from endpoint.jobs import JobStore

# A worker that writes its state file, leaves behind a child in its process group that keeps
# writing into the working directory (as the SDK's heartbeat process may), then does ``ends``.
WORKER = """
import os, signal, subprocess, sys, time
open(".runpod_jobs.pkl", "w").close()
subprocess.Popen([sys.executable, "-c",
                  "import time\\nwhile True:\\n    open('hb', 'w').close()\\n    time.sleep(0.01)"])
{ends}
"""


def supervisor(count: int, ends: str) -> main.Supervisor:
    command = [sys.executable, "-c", WORKER.format(ends=ends)]
    sup = main.Supervisor(count, "http://127.0.0.1:9/v2/local", None, JobStore(), command=command)
    deadline = time.monotonic() + 20
    while not all(os.path.exists(os.path.join(d, "hb")) for d in sup.workdirs.values()):
        assert time.monotonic() < deadline, "stand-in workers did not start"
        time.sleep(0.02)
    return sup


def group_gone(sup: main.Supervisor) -> bool:
    for proc in sup.procs.values():
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            continue
        with os.scandir("/proc") as entries:  # only zombies left, waiting to be reaped by init?
            for entry in entries:
                try:
                    with open(f"/proc/{entry.name}/stat") as stat:
                        state, _, group = stat.read().rsplit(")", 1)[1].split()[:3]
                except (OSError, ValueError):
                    continue
                if int(group) == proc.pid and state != "Z":
                    return False
    return True


def test_a_worker_that_exits_on_its_own_leaves_no_directory():
    sup = supervisor(1, "sys.exit(3)")
    (workdir,) = sup.workdirs.values()

    async def watch_until_gone():
        watcher = asyncio.create_task(sup.watch())
        while not sup.store.is_gone("local-worker-0"):
            await asyncio.sleep(0.05)
        watcher.cancel()

    try:
        asyncio.run(asyncio.wait_for(watch_until_gone(), 20))
        assert sup.procs["local-worker-0"].returncode == 3
        assert not os.path.exists(workdir)
        wait_for(lambda: group_gone(sup), 10)  # SIGKILLed processes take a moment to go
    finally:
        sup.stop()


def test_stop_leaves_no_directory_even_of_a_worker_deaf_to_sigterm(monkeypatch):
    monkeypatch.setattr(main, "STOP_GRACE_SECONDS", 0.5)
    sup = supervisor(2, "signal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(60)")
    workdirs = list(sup.workdirs.values())
    assert len(set(workdirs)) == 2 and all(os.path.isdir(d) for d in workdirs)
    sup.stop()
    assert all(p.returncode is not None for p in sup.procs.values())
    assert not any(os.path.exists(d) for d in workdirs)
    wait_for(lambda: group_gone(sup), 10)
    sup.stop()  # a second stop is harmless
