"""The server's streamed choices merged (`forerun.server.service.deltas`), without a model or uvicorn: every
stream's deltas in the order they come, until each ends, and never a wait for ever on a failed generation."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from forerun.server.stream import deltas


def streams_of(count: int) -> list[SimpleNamespace]:
    return [SimpleNamespace(queue=asyncio.Queue()) for _ in range(count)]


async def collected(streams, task) -> list[tuple]:
    return [item async for item in deltas(streams, task)]


def test_every_streams_deltas_come_tagged_until_each_has_ended():
    async def run() -> list[tuple]:
        streams = streams_of(2)
        finished = asyncio.get_running_loop().create_future()
        for item in [("a", None), ("b", [1]), None]:
            streams[0].queue.put_nowait(item)
        streams[1].queue.put_nowait(("x", None))

        async def later() -> None:  # the second stream goes on after the first has ended
            await asyncio.sleep(0.01)
            streams[1].queue.put_nowait(("y", None))
            streams[1].queue.put_nowait(None)
            finished.set_result("done")

        asyncio.get_running_loop().create_task(later())
        return await asyncio.wait_for(collected(streams, finished), 5)

    items = asyncio.run(run())
    assert [item for item in items if item[0] == 0] == [(0, "a", None), (0, "b", [1])]
    assert [item for item in items if item[0] == 1] == [(1, "x", None), (1, "y", None)]


@pytest.mark.parametrize("already", [True, False])
def test_a_failed_generation_ends_the_deltas_though_a_stream_never_ended(already):
    """One choice's generation failed (its stream never gets its end): what was sent is out, the rest is the
    error event's; `already`: the failure came before the merge began waiting, else while it waited."""

    async def run() -> list[tuple]:
        streams = streams_of(2)
        streams[0].queue.put_nowait(("a", None))
        failed = asyncio.get_running_loop().create_future()
        if already:
            failed.set_exception(RuntimeError("a row failed"))
        else:
            asyncio.get_running_loop().call_later(0.01, failed.set_exception, RuntimeError("a row failed"))
        items = await asyncio.wait_for(collected(streams, failed), 5)
        failed.exception()  # retrieved: no "never retrieved" warning
        return items

    assert asyncio.run(run()) == [(0, "a", None)]
