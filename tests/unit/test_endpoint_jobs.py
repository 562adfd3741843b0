"""The local endpoint's job store: states, single hand-out, streams, cancellation, execution
timeouts, workers lost and restarted under their id, and their states in /health (no HTTP)."""

import asyncio

from endpoint.jobs import JobStore, Status


def run(coro):
    return asyncio.run(coro)


def test_a_job_is_handed_to_exactly_one_worker():
    async def scenario():
        store = JobStore()
        jobs = [await store.submit({"n": i}) for i in range(5)]
        first = await store.take("w1", 3, timeout=0.1)
        second = await store.take("w2", 3, timeout=0.1)
        third = await store.take("w3", 3, timeout=0.1)
        return jobs, first, second, third

    jobs, first, second, third = run(scenario())
    assert [j.id for j in first + second] == [j.id for j in jobs] and third == []
    assert {j.worker for j in first} == {"w1"} and all(j.status is Status.IN_PROGRESS for j in jobs)


def test_take_waits_for_work_then_gives_up():
    async def scenario():
        store = JobStore()
        waiter = asyncio.create_task(store.take("w", 1, timeout=2))
        await asyncio.sleep(0.05)
        job = await store.submit({})
        return job, await waiter, await store.take("w", 1, timeout=0.05)

    job, taken, empty = run(scenario())
    assert [j.id for j in taken] == [job.id] and empty == []


def test_stream_then_done():
    async def scenario():
        store = JobStore()
        job = await store.submit({})
        await store.take("w", 1, timeout=0)
        await store.stream(job.id, "w", "a")
        await store.stream(job.id, "w", "b")
        await store.finish(job.id, "w", {"output": ["a", "b"]})
        await store.stream(job.id, "w", "late")  # after done: ignored
        return job

    job = run(scenario())
    assert job.chunks == ["a", "b"] and job.status is Status.COMPLETED and job.output == ["a", "b"]
    assert job.public()["output"] == ["a", "b"] and job.done_reports == 1


def test_failed_job_keeps_its_error():
    async def scenario():
        store = JobStore()
        job = await store.submit({})
        await store.take("w", 1, timeout=0)
        await store.finish(job.id, "w", {"error": '{"message": "bad"}'})
        return job, store.health(60)

    job, health = run(scenario())
    assert job.status is Status.FAILED and job.public()["error"] == '{"message": "bad"}'
    assert health["jobs"]["failed"] == 1


def test_cancel_in_progress_signals_its_worker_and_ignores_its_result():
    async def scenario():
        store = JobStore()
        job = await store.submit({})
        await store.take("w", 1, timeout=0)
        await store.cancel(job.id)
        stops = await store.stop_signals("w", timeout=0.1)
        await store.finish(job.id, "w", {"output": ["x"]})
        return job, stops, await store.stop_signals("w", timeout=0.05)

    job, stops, again = run(scenario())
    assert stops == [job.id] and again == []
    assert job.status is Status.CANCELLED and job.output is None and "output" not in job.public()


def test_cancel_queued_job_and_purge():
    async def scenario():
        store = JobStore()
        a, b, c = [await store.submit({}) for _ in range(3)]
        await store.cancel(a.id)
        purged = await store.purge()
        return store, (a, b, c), purged, await store.take("w", 5, timeout=0.05)

    store, jobs, purged, taken = run(scenario())
    assert purged == 2 and taken == [] and all(j.status is Status.CANCELLED for j in jobs)
    assert store.health(60)["jobs"]["inQueue"] == 0


def test_reports_from_another_worker_are_ignored():
    async def scenario():
        store = JobStore()
        job = await store.submit({})
        await store.take("w1", 1, timeout=0)
        await store.finish(job.id, "w2", {"output": ["x"]})
        return job

    assert run(scenario()).status is Status.IN_PROGRESS


def test_a_lost_worker_fails_its_jobs_and_leaves_the_health_count():
    async def scenario():
        store = JobStore()
        job = await store.submit({})
        await store.take("w", 1, timeout=0)
        before = store.health(60)["workers"]
        await store.forget("w", 2, restart_in=5)
        store.ping("w")  # a heartbeat the dead worker left behind
        await store.submit({})
        late = await store.take("w", 1, timeout=0)
        return job, before, store.health(60), late

    job, before, after, late = run(scenario())
    assert before == {"idle": 0, "running": 1, "ready": 1, "initializing": 0, "unhealthy": 0, "throttled": 0}
    assert after["workers"] == {"idle": 0, "running": 0, "ready": 0, "initializing": 0, "unhealthy": 1,
                                "throttled": 0}
    assert after["local"]["w"]["state"] == "restarting" and after["local"]["w"]["lastExitStatus"] == 2
    assert 0 < after["local"]["w"]["restartIn"] <= 5 and late == []
    assert job.status is Status.FAILED
    assert job.error == '{"message": "worker w exited", "type": "WorkerLost", "param": null, "code": 500}'


def test_a_revived_worker_takes_jobs_again_and_its_dead_process_is_not_heard():
    """The same id after a restart: the new process takes and reports jobs; what the dead one still
    sends (a report on its failed job, a long poll under way across the restart) changes nothing."""
    async def scenario():
        store = JobStore()
        store.revive("w")
        old = await store.submit({})
        await store.take("w", 1, timeout=0)
        stale_take = asyncio.create_task(store.take("w", 1, timeout=2))  # the dead process's long poll
        stale_stop = asyncio.create_task(store.stop_signals("w", timeout=2))
        await asyncio.sleep(0.05)
        await store.forget("w", 1, restart_in=0)
        store.revive("w")
        new = await store.submit({})
        taken_stale = await stale_take
        await store.finish(old.id, "w", {"output": ["from the dead process"]})
        taken = await store.take("w", 1, timeout=0)
        await store.cancel(new.id)
        return store, old, new, taken_stale, await stale_stop, taken, await store.stop_signals("w", 0)

    store, old, new, taken_stale, stale_stop, taken, stops = run(scenario())
    assert taken_stale == [] and stale_stop == [] and [j.id for j in taken] == [new.id]
    assert old.status is Status.FAILED and old.output is None and stops == [new.id]
    assert store.health(60)["local"]["w"] == {"state": "ready", "restarts": 1, "lastExitStatus": 1,
                                              "restartIn": None}


def test_health_shows_each_workers_state():
    async def scenario():
        store = JobStore()
        for worker in ("starting", "idle", "busy", "silent", "exited"):
            store.revive(worker)
        for worker in ("idle", "busy", "silent", "exited"):
            store.ping(worker)
        await store.submit({})
        await store.take("busy", 1, timeout=0)
        store.workers["silent"].seen -= 61  # called in once, silent since
        await store.forget("exited", -9, restart_in=30)
        return store.health(60)

    health = run(scenario())
    assert health["workers"] == {"idle": 1, "running": 1, "ready": 2, "initializing": 1, "unhealthy": 2,
                                 "throttled": 0}
    states = {worker: detail["state"] for worker, detail in health["local"].items()}
    assert states == {"starting": "initializing", "idle": "ready", "busy": "running",
                      "silent": "unresponsive", "exited": "restarting"}
    assert health["local"]["exited"]["lastExitStatus"] == -9 and health["local"]["idle"]["restarts"] == 0


def test_a_job_in_progress_past_the_execution_timeout_times_out_and_is_stopped():
    async def scenario():
        store = JobStore(execution_timeout=0.05)
        job, queued = await store.submit({}), await store.submit({})
        await store.take("w", 1, timeout=0)
        await store.wait_for(lambda: job.final)
        stops = await store.stop_signals("w", timeout=0)
        await store.stream(job.id, "w", "late")
        await store.finish(job.id, "w", {"output": ["late"]})
        return store, job, queued, stops

    store, job, queued, stops = run(scenario())
    assert job.status is Status.TIMED_OUT and stops == [job.id] and job.chunks == []
    assert job.public()["status"] == "TIMED_OUT" and "0.05 s" in job.public()["error"]
    assert "output" not in job.public() and job.done_reports == 1
    assert queued.status is Status.IN_QUEUE  # the timeout counts from the take
    assert store.health(60)["jobs"]["failed"] == 1


def test_a_job_that_ends_in_time_does_not_time_out_later():
    async def scenario():
        store = JobStore(execution_timeout=0.1)
        done, cancelled = await store.submit({}), await store.submit({})
        await store.take("w", 2, timeout=0)
        await store.finish(done.id, "w", {"output": ["x"]})
        await store.cancel(cancelled.id)
        await asyncio.sleep(0.3)  # past the timeout: no timer left to fire
        return store, done, cancelled, await store.stop_signals("w", timeout=0)

    store, done, cancelled, stops = run(scenario())
    assert (done.status, cancelled.status) == (Status.COMPLETED, Status.CANCELLED)
    assert stops == [cancelled.id] and store.health(60)["jobs"]["failed"] == 0
