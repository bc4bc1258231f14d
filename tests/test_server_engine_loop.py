"""The engine thread in-process, on a real tiny engine: admission limits, aborts, and what
happens when a step raises (contained if the engine is clean after it, fatal if not)."""
from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from augury.sampling_params import SamplingParams
from augury.server.engine_loop import EngineLoop, EngineUnavailable, QueueFull, RequestFailed
from helpers_server import shared_tiny_checkpoint

LONG = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory):
    from augury.config import EngineConfig
    from augury.builder import build_engine

    tiny: Path = shared_tiny_checkpoint(tmp_path_factory)
    return build_engine(EngineConfig.create(model=str(tiny), dtype="float32", device="cpu", max_num_seqs=2,
                                            log_stats_interval=0.0))


@pytest.fixture
def fatal() -> list[BaseException]:
    return []


@pytest.fixture
def make_loop(engine, fatal: list[BaseException]) -> Iterator:
    loops: list[EngineLoop] = []

    def make(max_queue_size: int = 4) -> EngineLoop:
        loop = EngineLoop(engine, max_queue_size, on_fatal=fatal.append)
        loop.start(asyncio.get_running_loop())
        loops.append(loop)
        return loop

    yield make
    for loop in loops:
        loop.stop()
    assert not engine.has_unfinished_requests()
    assert engine.allocator.num_free == engine.allocator.num_usable


async def _settle(loop: EngineLoop, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.02)):
        s = loop.snapshot
        if s.running == 0 and s.waiting == 0 and s.in_flight == 0 and s.kv_free_blocks == s.kv_usable_blocks:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"the engine did not settle: {loop.snapshot}")


async def _finish(group) -> list:
    return [out async for _, out in group.outputs()]


def test_completes_and_queue_is_bounded(make_loop) -> None:
    async def main() -> None:
        loop = make_loop(max_queue_size=1)  # capacity: 2 running + 1 waiting
        assert loop.capacity == 3
        a = loop.submit("a", [[5, 6, 7], [8, 9]], [LONG, LONG])
        b = loop.submit("b", [[10, 11]], [LONG])
        with pytest.raises(QueueFull):
            loop.submit("c", [[12]], [LONG])
        a.abort()
        b.abort()
        await _settle(loop)
        done = loop.submit("d", [[5, 6, 7]], [SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)])
        outs = await _finish(done)
        assert outs[-1].finished and len(outs[-1].token_ids) == 5
        assert sum(len(o.new_token_ids) for o in outs) == 5

    asyncio.run(main())


def test_abort_frees_kv_blocks_mid_generation(make_loop) -> None:
    async def main() -> None:
        loop = make_loop()
        group = loop.submit("x", [[5, 6, 7, 8]], [LONG])
        async for _, out in group.outputs():
            assert not out.finished
            break
        assert loop.snapshot.kv_free_blocks < loop.snapshot.kv_usable_blocks  # published before the output
        group.abort()
        await _settle(loop)

    asyncio.run(main())


def test_engine_rejection_is_a_400_for_that_request_only(make_loop, engine) -> None:
    async def main() -> None:
        loop = make_loop()
        too_long = [5] * (engine.max_model_len + 1)
        with pytest.raises(RequestFailed) as info:
            await _finish(loop.submit("bad", [too_long], [LONG]))
        assert info.value.status == 400
        outs = await _finish(loop.submit("ok", [[5, 6]], [SamplingParams(max_tokens=3, temperature=0.0)]))
        assert outs[-1].finished

    asyncio.run(main())


def test_failed_step_fails_its_requests_and_serving_goes_on(make_loop, engine, fatal, monkeypatch) -> None:
    real_step = engine.step
    calls = {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return real_step()

    monkeypatch.setattr(engine, "step", flaky_step)

    async def main() -> None:
        loop = make_loop()
        with pytest.raises(RequestFailed) as info:
            await _finish(loop.submit("victim", [[5, 6, 7]], [LONG]))
        assert info.value.status == 500 and "RuntimeError" in str(info.value)
        await _settle(loop)
        assert loop.snapshot.step_errors == 1 and loop.alive and not fatal
        outs = await _finish(loop.submit("next", [[5, 6]], [SamplingParams(max_tokens=3, temperature=0.0)]))
        assert outs[-1].finished

    asyncio.run(main())


def test_failed_step_leaving_a_mess_stops_the_loop(make_loop, engine, fatal, monkeypatch) -> None:
    taken: list[int] = []

    def leaky_step():
        taken.extend(engine.allocator.allocate(1))  # a step that dies holding a block: the engine is not clean
        raise RuntimeError("leak")

    monkeypatch.setattr(engine, "step", leaky_step)

    async def main() -> None:
        loop = make_loop()
        with pytest.raises(RequestFailed):
            await _finish(loop.submit("victim", [[5, 6, 7]], [LONG]))
        for _ in range(200):
            if fatal:
                break
            await asyncio.sleep(0.02)
        assert fatal and "inconsistent" in str(fatal[0])
        assert not loop.alive and not loop.snapshot.alive
        with pytest.raises(EngineUnavailable):
            loop.submit("after", [[5]], [LONG])

    asyncio.run(main())
    engine.allocator.free(taken)  # the module's engine is shared: hand back what the fake step took


def test_health_is_503_until_ready(engine, tmp_path_factory: pytest.TempPathFactory) -> None:
    from starlette.testclient import TestClient

    from augury.server.args import build_parser, settings_from_args
    from augury.server.httpserver import build_server

    tiny = shared_tiny_checkpoint(tmp_path_factory)
    settings = settings_from_args(build_parser().parse_args(["--model", str(tiny), "--port", "0"]))
    server = build_server(settings, engine, {})
    with TestClient(server.config.app) as http:
        assert http.get("/health").status_code == 503  # built, not yet serving
        server.state.ready = True
        assert http.get("/health").status_code == 503  # the engine thread is not running
        r = http.post("/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
