"""Notices (sdfarm.store.notices) on a real redis-server: hundreds of listeners, subscribing all
at once, share ONE pub/sub connection; the events the scripts append wake every listener of
the job; channels are unsubscribed when the last listener leaves; and Job.result_async gives
Job.result's answers (cancelled, unknown job, timeout) over it."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from sdfarm.client.farm import Farm, FarmError, JobCancelled
from sdfarm.store import JobSpec, Store
from sdfarm.store.aio import AsyncStore

SPEC = JobSpec(model="m", params={"prompt": "a cat", "width": 64, "height": 64})
JOBS = 50
LISTENERS = 200


def test_one_connection_wakes_every_listener(redis_url: str) -> None:
    store = Store.connect(redis_url)
    ids = [store.submit(SPEC, 1000)[0] or "" for _ in range(JOBS)]

    async def run() -> Counter[str]:
        aio = AsyncStore.connect(redis_url)
        woken: Counter[str] = Counter()
        entered = 0
        all_in = asyncio.Event()

        async def listen(job_id: str) -> None:
            nonlocal entered
            async with aio.listen(job_id) as notice:
                entered += 1
                if entered == LISTENERS:
                    all_in.set()
                assert await notice.wait(10)
                woken[job_id] += 1

        try:
            tasks = [asyncio.create_task(listen(ids[k % JOBS])) for k in range(LISTENERS)]
            await asyncio.wait_for(all_in.wait(), 10)
            subscribers = [c for c in store.r.client_list() if int(c.get("sub", 0)) > 0]
            assert len(subscribers) == 1  # one connection for all of them
            assert int(subscribers[0]["sub"]) == JOBS  # one channel per job, refcounted
            assert aio.notices.watched() == JOBS
            for job_id in ids:  # each cancel appends (and publishes) a `cancelled` event
                await asyncio.to_thread(store.cancel, job_id)
            await asyncio.wait_for(asyncio.gather(*tasks), 10)
            await asyncio.sleep(0.1)
            assert aio.notices.watched() == 0
            assert await aio.r.pubsub_channels() == []  # unsubscribed by the last one out
        finally:
            await aio.close()
        return woken

    woken = asyncio.run(run())
    store.close()
    assert woken == Counter({job_id: LISTENERS // JOBS for job_id in ids})


def test_result_async_answers_as_result_does(redis_url: str) -> None:
    with Farm(redis_url, retry_s=1.0) as farm:
        queued = farm.job(farm.store.submit(SPEC, 1000)[0] or "")
        to_cancel = farm.job(farm.store.submit(SPEC, 1000)[0] or "")

        async def run() -> None:
            aio = AsyncStore.connect(redis_url)
            try:
                with pytest.raises(TimeoutError):
                    await queued.result_async(aio, 0.3)
                with pytest.raises(FarmError, match="no job"):
                    await farm.job("f" * 32).result_async(aio, 1)
                waiting = asyncio.create_task(to_cancel.result_async(aio, 10))
                await asyncio.sleep(0.2)
                assert not waiting.done()
                await asyncio.to_thread(to_cancel.cancel)
                with pytest.raises(JobCancelled):
                    await asyncio.wait_for(waiting, 5)  # woken by the event, not a slice
            finally:
                await aio.close()

        asyncio.run(run())
        with pytest.raises(JobCancelled):
            to_cancel.result(1)
