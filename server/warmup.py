"""Start-up warm-up through the real request path, so the first requests answer as fast as later ones.

`engine.warmup.warm_up` runs decode rounds on tiny prompts; a user's first request needs more:
a chat prompt longer than a prefill chunk (chunked prefill, the chunked GatedDeltaNet and the
blocked prefill attention), the sampling pipeline (temperature, top-p/k, min-p, penalties,
seeded and not), batches of two rows, and the depth policy's first cost measurements. On a
fresh machine each of those first compiles fused kernels (MLX's JIT, seconds apiece on g++:
the first request took 17.7 s for 200 tokens, later ones 1-2.4 s). This sends such requests
through the engine, with the prompt cache set aside (nothing a user sends can match them).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import List, Tuple

from mtp_serve.engine.sampling import SamplingParams
from mtp_serve.engine.warmup import kernel_cache_files

log = logging.getLogger("mtp_serve")

TEXT = ("Read the configuration file, validate every field against the schema, and report each "
        "problem with its line number. Then write a function that merges two sorted lists. ")

SAMPLED = dict(temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, presence_penalty=0.1, frequency_penalty=0.1,
               repetition_penalty=1.05)


@dataclass
class WarmUpReport:
    seconds: float
    requests: int
    new_kernels: int  # fused kernels MLX compiled (0 when its cache already held them)

    def line(self) -> str:
        why = (f"compiled {self.new_kernels} kernels (a first start on this machine; MLX caches them on disk for the next)"
               if self.new_kernels else "kernels were already cached")
        return (f"warm-up through the engine: {self.requests} requests (chunked prefill, sampling, batches, "
                f"depth costs) in {self.seconds:.1f}s; {why}")


def warm_up_prompts(svc) -> Tuple[List[int], List[int]]:
    """Two chat prompts: one a little longer than a prefill chunk (within half the context) and
    one short. Neither length is a multiple of 64, so prefill runs both forms of the fast exp
    kernels (`models/fast_math.py`: rows in multiples of 64 and the rest, compiled apart)."""
    target = min(svc.config.prefill_chunk + 37, svc.max_context // 2)
    text = TEXT
    while True:
        ids = svc.chat.render([{"role": "system", "content": "You are a helpful assistant."},
                               {"role": "user", "content": text}]).ids
        if len(ids) >= target or len(text) > 64 * target:
            break
        text += TEXT
    short = svc.chat.render([{"role": "user", "content": "Merge two sorted lists."}]).ids
    return ids[:max(2, target)], short[:max(2, min(len(short), target - 1))]


async def warm_up(svc) -> WarmUpReport:
    """Run the warm-up requests one after another, then two at once; the engine must be running."""
    before = kernel_cache_files()
    t0 = time.perf_counter()
    long, short = warm_up_prompts(svc)
    depth = svc.config.mtp_depth
    scheduler = svc.engine.scheduler
    kept, scheduler.prompt_cache = scheduler.prompt_cache, None
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    seeded = SamplingParams(max_tokens=8, ignore_eos=True, seed=1, **SAMPLED)
    unseeded = SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.0)
    runs = [(long, greedy), (short, greedy), (short, seeded), (long, unseeded)]

    async def run(ids: List[int], params: SamplingParams) -> None:
        async for _ in svc.engine.submit(ids, params, depth):
            pass

    try:
        for ids, params in runs:
            await run(ids, params)
        await asyncio.gather(run(long, greedy), run(short, seeded))
    finally:
        scheduler.prompt_cache = kept
    return WarmUpReport(time.perf_counter() - t0, len(runs) + 2, max(0, kernel_cache_files() - before))
