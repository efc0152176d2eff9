"""The engine loop alone: interleaving keeps each request's output, errors stay per
request, cancel frees the slot, the queue is bounded."""

import asyncio

import pytest

from mtp_serve.engine.engine_loop import EngineError, EngineLoop, QueueFull
from mtp_serve.engine.generator import generate
from mtp_serve.engine.sampling import SamplingParams

PROMPTS = [[5, 17, 99, 3, 42], [30, 33, 36, 39], [200, 201, 202, 7, 8, 9]]


def _direct(lm, prompt, n, depth):
    out = []
    for c in generate(lm.model, lm.tokenizer, prompt, SamplingParams(max_tokens=n, ignore_eos=True), depth):
        out += c.token_ids
    return out


async def _collect(handle):
    out, finish = [], None
    async for c in handle:
        out += c.token_ids
        finish = c.finish_reason
    return out, finish


@pytest.fixture(scope="module")
def lm(loaded):
    return loaded("qwen3_5", agreeable=True)


def test_interleaved_requests_match_direct_runs(lm):
    expected = [_direct(lm, p, 12, d) for p, d in zip(PROMPTS, (2, 0, 1))]
    engine = EngineLoop(lm.model, lm.tokenizer).start()
    try:
        async def main():
            handles = [engine.submit(p, SamplingParams(max_tokens=12, ignore_eos=True), d) for p, d in zip(PROMPTS, (2, 0, 1))]
            return await asyncio.gather(*[_collect(h) for h in handles])

        results = asyncio.run(main())
    finally:
        engine.stop()
    assert [r[0] for r in results] == expected
    assert all(r[1] == "length" for r in results)


def test_failing_request_gets_an_error_and_the_loop_goes_on(lm):
    engine = EngineLoop(lm.model, lm.tokenizer).start()
    try:
        async def main():
            bad = engine.submit([], SamplingParams(max_tokens=4), 0)  # new_sequence rejects an empty prompt
            good = engine.submit(PROMPTS[0], SamplingParams(max_tokens=4, ignore_eos=True), 2)
            with pytest.raises(EngineError, match="at least one token"):
                await _collect(bad)
            return await _collect(good)

        out, finish = asyncio.run(main())
    finally:
        engine.stop()
    assert len(out) == 4 and finish == "length"
    assert engine.active_count == 0


def test_cancel_frees_the_slot_and_queue_is_bounded(lm):
    engine = EngineLoop(lm.model, lm.tokenizer, max_queue=1, max_active=1).start()
    try:
        async def main():
            long = engine.submit(PROMPTS[0], SamplingParams(max_tokens=100000, ignore_eos=True), 0)
            agen = long.__aiter__()
            await agen.__anext__()  # running
            waiting = engine.submit(PROMPTS[1], SamplingParams(max_tokens=3, ignore_eos=True), 0)
            with pytest.raises(QueueFull):
                engine.submit(PROMPTS[2], SamplingParams(max_tokens=3), 0)
            steps = engine.steps
            long.cancel()
            out, finish = await _collect(waiting)  # gets the slot once the long one is dropped
            assert len(out) == 3 and finish == "length"
            assert engine.steps - steps <= 3 + 2
            async for _ in agen:  # the cancelled stream just ends
                pass

        asyncio.run(main())
    finally:
        engine.stop()
    assert engine.active_count == 0 and engine.queue_depth == 0


def test_max_queue_counts_requests_beyond_free_slots(lm):
    """max_queue bounds the requests waiting beyond the free batch slots: with 4 free slots
    and max_queue 1, five requests submitted at once are all taken."""
    engine = EngineLoop(lm.model, lm.tokenizer, max_queue=1, max_active=4).start()
    try:
        async def main():
            handles = [engine.submit(PROMPTS[i % 3], SamplingParams(max_tokens=2, ignore_eos=True), 0) for i in range(5)]
            return await asyncio.gather(*[_collect(h) for h in handles])

        results = asyncio.run(main())
    finally:
        engine.stop()
    assert [f for _, f in results] == ["length"] * 5


def test_a_failure_inside_one_round_fails_its_rows_and_the_loop_goes_on(lm, monkeypatch):
    """The backbone raises once in the middle of a batched round (as an MLX error or an
    out-of-memory would): that round's requests end with an EngineError, nothing hangs, and
    requests running or arriving afterwards decode exactly as they do alone."""
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    expected = _direct(lm, PROMPTS[2], 12, 2)
    model = lm.model
    forward = model.forward
    armed = {"rounds": None}

    def failing_forward(inputs, cache, *a, **k):
        if armed["rounds"] is not None and inputs.shape[0] == 2:  # a batched verify of the two running rows
            armed["rounds"] = None
            raise RuntimeError("[metal::malloc] Attempting to allocate more memory than is available")
        return forward(inputs, cache, *a, **k)

    monkeypatch.setattr(model, "forward", failing_forward)
    engine = EngineLoop(lm.model, lm.tokenizer, max_active=2).start()
    try:
        async def main():
            a = engine.submit(PROMPTS[0], SamplingParams(max_tokens=100000, ignore_eos=True), 2)
            b = engine.submit(PROMPTS[1], SamplingParams(max_tokens=100000, ignore_eos=True), 0)
            ia, ib = a.__aiter__(), b.__aiter__()
            await ia.__anext__()
            await ib.__anext__()  # both running in one batch
            waiting = engine.submit(PROMPTS[2], params, 2)  # no free slot: waits through the failure
            armed["rounds"] = 1
            outcomes = []
            for it in (ia, ib):
                with pytest.raises(EngineError, match="allocate more memory"):
                    async for _ in it:
                        pass
                outcomes.append("failed")
            later = engine.submit(PROMPTS[2], params, 2)
            return outcomes, await asyncio.wait_for(asyncio.gather(_collect(waiting), _collect(later)), 60)

        outcomes, results = asyncio.run(main())
    finally:
        engine.stop()
    assert outcomes == ["failed", "failed"]
    assert results == [(expected, "length")] * 2
    assert engine.active_count == 0 and engine.queue_depth == 0 and not engine.scheduler.seqs
