"""The local endpoint's worker supervisor with stand-in workers (no engine): the back-off between
restarts; a worker that exits is started again under its id, in a fresh working directory, once
its process group is empty and its old directory gone; ``stop`` leaves no process or directory and
cancels a pending restart; with ``--image`` each start is a new container, the old one removed."""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import time
from pathlib import Path

import endpoint.supervisor as supervision
from conftest import wait_for
from endpoint.container import ContainerLauncher
from endpoint.jobs import JobStore

# A worker that counts its runs in ``runs``, writes its state file, leaves behind a child in its
# process group that keeps writing into the working directory (as the SDK's heartbeat process may),
# then does ``ends`` (``run`` is its run's number).
WORKER = """
import os, signal, subprocess, sys, time
from pathlib import Path
runs = Path({runs!r})
with runs.open("a") as f:  # one appended line per start: two stand-ins starting at once both count
    f.write("run\\n")
run = len(runs.read_text().splitlines())
open(".runpod_jobs.pkl", "w").close()
subprocess.Popen([sys.executable, "-c",
                  "import time\\nwhile True:\\n    open('hb', 'w').close()\\n    time.sleep(0.01)"])
while not os.path.exists("hb"):
    time.sleep(0.01)
{ends}
"""
EXIT_FIRST_RUN = "if run == 1:\n    sys.exit(3)\ntime.sleep(60)"
DEAF = "signal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(60)"


def worker_code(tmp_path: Path, ends: str) -> str:
    return WORKER.format(runs=str(tmp_path / "runs"), ends=ends)


def runs(tmp_path: Path) -> int:
    """How many times the stand-in has started."""
    path = tmp_path / "runs"
    return len(path.read_text().splitlines()) if path.exists() else 0


def supervisor(count: int, code: str, container: ContainerLauncher | None = None) -> supervision.Supervisor:
    return supervision.Supervisor(count, "http://127.0.0.1:9/v2/local", None, JobStore(),
                           command=[sys.executable, "-c", code], container=container)


async def serving(sup: supervision.Supervisor) -> None:
    """Until every worker's latest stand-in and its child run."""
    deadline = time.monotonic() + 20
    while not (len(sup.lives) == len(sup.workers)
               and all(os.path.exists(os.path.join(life.workdir, "hb")) for life in sup.lives.values())):
        assert time.monotonic() < deadline, "stand-in workers did not start"
        await asyncio.sleep(0.02)


async def started(sup: supervision.Supervisor) -> asyncio.Task:
    """``sup.run()`` under way, once every worker's stand-in and its child run."""
    task = asyncio.create_task(sup.run())
    await serving(sup)
    return task


async def stopped(sup: supervision.Supervisor, task: asyncio.Task) -> None:
    """As the endpoint stops: the restarts cancelled, then the workers stopped."""
    task.cancel()
    await asyncio.wait({task})
    await asyncio.to_thread(sup.stop)


def group_gone(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return True
    with os.scandir("/proc") as entries:  # only zombies left, waiting to be reaped by init?
        for entry in entries:
            try:
                with open(f"/proc/{entry.name}/stat") as stat:
                    state, _, group = stat.read().rsplit(")", 1)[1].split()[:3]
            except (OSError, ValueError):
                continue
            if int(group) == pid and state != "Z":
                return False
    return True


def test_the_backoff_doubles_from_1_s_to_30_s_and_starts_again_after_60_s_up():
    backoff = supervision.Backoff()
    assert [backoff.after_exit(0.5) for _ in range(7)] == [1, 2, 4, 8, 16, 30, 30]
    assert [backoff.after_exit(60), backoff.after_exit(59.9), backoff.after_exit(0)] == [1, 2, 4]
    assert [backoff.after_exit(3600), backoff.after_exit(1)] == [1, 2]
    waits = [backoff.after_exit(0) for _ in range(5000)]  # a worker that never stays up
    assert waits[:5] == [4, 8, 16, 30, 30] and set(waits[3:]) == {30}


def test_a_worker_that_exits_is_restarted_under_its_id_once_its_group_and_directory_are_gone(
        tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(supervision, "BACKOFF_FIRST_SECONDS", 0.2)
    sup = supervisor(1, worker_code(tmp_path, EXIT_FIRST_RUN))

    async def scenario():
        task = asyncio.create_task(sup.run())
        while "local-worker-0" not in sup.lives:
            await asyncio.sleep(0.01)
        first = sup.lives["local-worker-0"]
        while sup.lives["local-worker-0"] is first:  # the restart
            await asyncio.sleep(0.01)
        assert first.reaped and first.proc.returncode == 3 and not os.path.exists(first.workdir)
        await asyncio.to_thread(wait_for, lambda: group_gone(first.proc.pid), 10)  # SIGKILLed: a moment
        await serving(sup)  # the second run
        assert sup.lives["local-worker-0"].workdir != first.workdir
        health = sup.store.health(60)["local"]["local-worker-0"]
        await stopped(sup, task)
        return first, health

    try:
        first, health = asyncio.run(asyncio.wait_for(scenario(), 30))
    finally:
        sup.stop()
    assert runs(tmp_path) == 2 and not os.path.exists(sup.lives["local-worker-0"].workdir)
    assert health == {"state": "initializing", "restarts": 1, "lastExitStatus": 3, "restartIn": None}
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("endpoint:")]
    assert len(lines) == 1
    assert re.fullmatch(r"endpoint: local-worker-0 exited with status 3 after \d+\.\d s; "
                        r"restarting in 0\.2 s \(restart 1\)", lines[0])


def test_stop_leaves_no_directory_even_of_a_worker_deaf_to_sigterm(tmp_path, monkeypatch):
    monkeypatch.setattr(supervision, "STOP_GRACE_SECONDS", 0.5)
    sup = supervisor(2, worker_code(tmp_path, DEAF))

    async def scenario():
        task = await started(sup)
        lives = list(sup.lives.values())
        assert len({life.workdir for life in lives}) == 2 and all(os.path.isdir(life.workdir) for life in lives)
        await stopped(sup, task)
        return lives

    try:
        lives = asyncio.run(asyncio.wait_for(scenario(), 30))
    finally:
        sup.stop()
    assert all(life.proc.returncode is not None for life in lives)
    assert not any(os.path.exists(life.workdir) for life in lives)
    for life in lives:
        wait_for(lambda pid=life.proc.pid: group_gone(pid), 10)
    sup.stop()  # a third stop is harmless
    assert runs(tmp_path) == 2  # nothing restarted


def test_stop_cancels_a_pending_restart(tmp_path, monkeypatch):
    monkeypatch.setattr(supervision, "BACKOFF_FIRST_SECONDS", 60)
    sup = supervisor(1, worker_code(tmp_path, "sys.exit(1)"))

    async def scenario():
        task = asyncio.create_task(sup.run())
        while not (sup.store.is_gone("local-worker-0") and sup.lives["local-worker-0"].reaped):
            await asyncio.sleep(0.02)
        assert sup.store.health(60)["workers"]["unhealthy"] == 1
        await stopped(sup, task)

    try:
        asyncio.run(asyncio.wait_for(scenario(), 30))
    finally:
        sup.stop()
    assert runs(tmp_path) == 1 and not os.path.exists(sup.lives["local-worker-0"].workdir)


# A stand-in for buildah: records its calls; ``inspect`` describes an image whose command is the
# stand-in worker, ``from`` names a new container, ``run`` runs the command after ``--`` in place.
FAKE_BUILDAH = """#!{python}
import json, os, sys
from pathlib import Path
log = Path({log!r})
with log.open("a") as file:
    file.write(json.dumps(sys.argv[1:]) + "\\n")
if sys.argv[1] == "inspect":
    print(json.dumps({{"OCIv1": {{"config": {{"Entrypoint": [{python!r}, "-c"], "Cmd": [{code!r}]}}}}}}))
elif sys.argv[1] == "from":
    print("container-" + str(sum(json.loads(line)[0] == "from" for line in log.read_text().splitlines())))
elif sys.argv[1] == "run":
    command = sys.argv[sys.argv.index("--") + 1:]
    os.execv(command[0], command)
"""


def test_an_image_worker_is_restarted_in_a_new_container_once_the_old_one_is_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(supervision, "BACKOFF_FIRST_SECONDS", 0.2)
    log = tmp_path / "buildah.log"
    fake = tmp_path / "bin" / "buildah"
    fake.parent.mkdir()
    fake.write_text(FAKE_BUILDAH.format(python=sys.executable, log=str(log),
                                        code=worker_code(tmp_path, EXIT_FIRST_RUN)))
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    sup = supervisor(1, "", container=ContainerLauncher("localhost/worker:test"))

    async def scenario():
        task = asyncio.create_task(sup.run())
        while runs(tmp_path) < 2:
            await asyncio.sleep(0.02)
        await serving(sup)
        await stopped(sup, task)

    try:
        asyncio.run(asyncio.wait_for(scenario(), 30))
    finally:
        sup.stop()
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    calls = [call[:call.index("--")] if "--" in call else call for call in calls]  # run: up to the command
    pid = os.getpid()
    assert [call[0] for call in calls] == ["inspect", "from", "run", "rm", "from", "run", "rm"]
    assert calls[1][-3:] == ["--name", f"local-worker-0-{pid}-1", "localhost/worker:test"]
    assert calls[2][-1] == "container-1" and calls[3] == ["rm", "container-1"]
    assert calls[4][-3:] == ["--name", f"local-worker-0-{pid}-2", "localhost/worker:test"]
    assert calls[5][-1] == "container-2" and calls[6] == ["rm", "container-2"]
    assert "--env=RUNPOD_POD_ID=local-worker-0" in calls[5]  # the same worker id
    assert runs(tmp_path) == 2
