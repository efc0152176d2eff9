"""Several choices from one request: OpenAI's `n`, and the prompts of a batched
/v1/completions request. Each choice is its own `Run`, all submitted together, so the
engine decodes them as rows of one batch; each row is exact on its own (a greedy choice
is the single request's output; choice k of a seeded request draws with seed + k).

    runs = start(lambda k: svc.start(..., seed_offset=k), n)   # all or none submitted
    done = await complete(runs)                               # non-streamed, in order
    async for k, step in steps(runs): ...                     # streamed, as they come
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable, List, Sequence, Tuple

from mtp_serve.server.run import Completion, Run, Step, Usage


def start(make: Callable[[int], Run], count: int) -> List[Run]:
    """`make(k)` for k in 0..count-1; when one is refused (a 400, a full queue) the ones
    already submitted are cancelled."""
    runs: List[Run] = []
    try:
        for k in range(count):
            runs.append(make(k))
    except BaseException:
        for r in runs:
            r.handle.cancel()
        raise
    return runs


async def complete(runs: List[Run]) -> List[Completion]:
    """Every run's output, in order. A failure (or a client gone) stops the others."""
    if len(runs) == 1:
        return [await runs[0].complete()]
    tasks = [asyncio.ensure_future(r.complete()) for r in runs]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()


async def steps(runs: List[Run]) -> AsyncIterator[Tuple[int, Step]]:
    """Every run's steps as they come, with the run's index. A failure in one ends all."""
    if len(runs) == 1:
        async for step in runs[0].steps():
            yield 0, step
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(k: int, run: Run) -> None:
        try:
            async for step in run.steps():
                await queue.put((k, step, None))
            await queue.put((k, None, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put((k, None, e))

    tasks = [asyncio.ensure_future(pump(k, r)) for k, r in enumerate(runs)]
    try:
        left = len(runs)
        while left:
            k, step, error = await queue.get()
            if error is not None:
                raise error
            if step is None:
                left -= 1
                continue
            yield k, step
    finally:
        for t in tasks:
            t.cancel()


def total_usage(usages: Sequence[Usage], stats: Sequence, per_prompt: int) -> Usage:
    """One request's usage over its choices (prompt-major, `per_prompt` choices each): each
    prompt counted once, as OpenAI does; every choice's output tokens; MTP figures summed."""
    if len(usages) == 1:
        return usages[0]
    firsts = usages[::per_prompt]
    note = next((u.note for u in usages if u.note), {})
    return Usage(sum(u.prompt_tokens for u in firsts), sum(u.cached_tokens for u in firsts),
                 sum(u.output_tokens for u in usages), speculative(stats), note, sum(u.image_tokens for u in firsts))


def speculative(stats: Sequence) -> dict:
    """The MTP figures (run.SPECULATIVE_KEYS, the same names) of several requests together."""
    width = max(len(s.drafted) for s in stats)

    def per_position(name: str) -> List[int]:
        return [sum(getattr(s, name)[j] for s in stats if j < len(getattr(s, name))) for j in range(width)]

    drafted, accepted = per_position("drafted"), per_position("accepted")
    passes = sum(s.backbone_passes for s in stats)
    return {"depth": max(s.depth for s in stats), "drafted": sum(drafted), "accepted": sum(accepted),
            "acceptance_rate": round(sum(accepted) / sum(drafted), 4) if sum(drafted) else 0.0,
            "drafted_per_position": drafted, "accepted_per_position": accepted,
            "tokens_per_pass": round(sum(max(s.generated_tokens - 1, 0) for s in stats) / passes, 4) if passes else 0.0}
