"""The start-up watchdog's clock: download progress not counted, the phase a start is in, and a start
past the bound (the endpoint tests run it on real workers: tests/endpoint/test_startup_timeout.py)."""

from __future__ import annotations

import logging
import re
import threading

import pytest

from worker.startup import watchdog as watchdog_module
from worker.startup.watchdog import PHASES, Abandoned, Watchdog
from worker.wire.errors import StartupError


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def test_time_between_signs_of_download_progress_is_not_counted(clock):
    dog, downloaded = Watchdog(60, clock), [0]
    clock.now += 2  # the preflight
    dog.enter("download", lambda: downloaded[0])
    for _ in range(10):  # ten pieces, 30 s apart
        clock.now += 30
        downloaded[0] += 10 << 20
        assert dog.counted() == pytest.approx(2)
    clock.now += 50  # then nothing more arrives: counted from the last piece on
    assert dog.counted() == pytest.approx(52) and dog.free == pytest.approx(300)
    assert dog.current() == ("download", clock.now - 50)


def test_the_other_phases_count_in_full(clock):
    dog = Watchdog(60, clock)
    clock.now += 3
    dog.enter("load")
    clock.now += 40
    assert dog.counted() == pytest.approx(43) and dog.current() == ("load", clock.now - 40)


def test_while_loading_the_engines_own_phase_is_the_phase(clock):
    dog = Watchdog(60, clock)
    dog.enter("load")
    clock.now += 10
    assert dog.current()[0] == "load"
    dog.engine_phase = lambda: ("compile", 4.0)  # the weights loaded 4 s ago
    assert dog.current() == ("compile", clock.now - 4)
    dog.enter("warm-up")  # the engine has started: its notes no longer say where the start is
    assert dog.current() == ("warm-up", clock.now)


def test_each_phase_is_logged_once_as_the_start_enters_it(clock, caplog):
    caplog.set_level(logging.INFO)
    dog = Watchdog(60, clock)
    for phase in ("download", "download", "load", "warm-up"):
        clock.now += 1
        dog.enter(phase, (lambda: 0) if phase == "download" else None)
    assert [r.getMessage() for r in caplog.records] == [
        "Start-up phase: download, 1.0 s after the start", "Start-up phase: load, 3.0 s after the start",
        "Start-up phase: warm-up, 4.0 s after the start"]


def test_a_start_that_ends_in_time_gives_its_result_or_its_exception():
    assert Watchdog(60).run(lambda: 42) == 42
    with pytest.raises(StartupError, match="bad"):
        Watchdog(60).run(lambda: (_ for _ in ()).throw(StartupError("bad")))
    assert Watchdog(0).run(lambda: "no bound") == "no bound"


def test_a_start_past_the_bound_is_abandoned_naming_the_setting_the_phase_and_the_time(monkeypatch):
    killed, release = [], threading.Event()
    monkeypatch.setattr(watchdog_module, "kill_children", lambda: killed.append(True))
    dog = Watchdog(0.5)

    def start() -> None:
        dog.enter("load")
        release.wait(30)
        dog.enter("warm-up")  # raises: the watchdog gave up

    with pytest.raises(StartupError) as raised:
        dog.run(start)
    message = str(raised.value)
    assert re.match(r"the worker did not become ready within VLLM_STARTUP_TIMEOUT=0\.5 s: "
                    r"\d+ s after its start, the last \d+ s in phase 'load'", message)
    assert f"in phase 'load', {PHASES['load']}" in message and killed == [True]
    assert not raised.value.variables  # exit status 1: the next worker may start
    with pytest.raises(Abandoned):
        dog.enter("warm-up")
    release.set()
