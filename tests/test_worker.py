"""The device worker thread (execution/worker.py): calls in order on its own
thread, errors to the caller, shutdown cancels what has not started and
join waits for the running call, an initializer's failure reported by every
call."""
import asyncio
import threading

import pytest

from tessera_actors.execution.worker import Worker


def test_calls_run_in_order_on_the_thread_and_errors_reach_the_caller():
    async def main():
        w = Worker("dev-test")
        got = await asyncio.gather(*(w.call(lambda i=i: (i, threading.current_thread().name)) for i in range(8)))
        assert got == [(i, "dev-test") for i in range(8)]
        with pytest.raises(ZeroDivisionError):
            await w.call(lambda: 1 / 0)
        assert await w.call(lambda a, b: a + b, 2, 3) == 5   # the thread goes on after an error
        assert w.submit(lambda: 7).result(timeout=10) == 7   # from any thread, a concurrent future
        assert w.pending == 0
        w.shutdown()
    asyncio.run(main())


def test_shutdown_cancels_the_calls_not_started_and_lets_the_running_one_finish():
    async def main():
        w = Worker("dev-test")
        running, release = threading.Event(), threading.Event()

        def hold():
            running.set()
            release.wait(10)
            return "done"
        first = w.call(hold)
        later = w.call(lambda: "never")
        await asyncio.to_thread(running.wait, 10)
        assert w.pending == 1
        w.shutdown()
        assert not w.join(0.05)   # a stopping device waits for the running call: it is still running
        release.set()
        assert await asyncio.wait_for(first, 10) == "done"
        assert later.cancelled()
        assert w.join(10)         # then the thread has ended: nothing of it left inside torch at exit
    asyncio.run(main())


def test_a_failed_initializer_fails_every_call():
    async def main():
        w = Worker("dev-test", lambda: 1 / 0)
        with pytest.raises(RuntimeError, match="could not start: ZeroDivisionError"):
            await asyncio.wait_for(w.call(lambda: 1), 10)
        w.shutdown()
    asyncio.run(main())
