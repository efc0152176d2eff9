"""One request, start to finish, through the same scheduler the server runs:

    for chunk in generate(model, tokenizer, prompt_ids, params, depth=2): ...

`depth=0` (or a model without an MTP head) decodes plainly. By default every
round drafts exactly `depth` tokens; pass a `DepthPolicy` to let the measured
policy choose (what `mtp-serve` and `mtp-generate` do).
"""

from __future__ import annotations

from typing import Iterator, List, Optional

from mtp_serve.models.mtp_model import MTPModel

from .chunks import GenerationChunk
from .policy import DepthPolicy
from .prompt_cache import PromptCache
from .sampling import SamplingParams
from .context_drafts import MAX_COPY
from .scheduler import Scheduler


def generate(
    model: MTPModel,
    tokenizer,
    prompt: List[int],
    params: SamplingParams,
    depth: int = 0,
    prompt_cache: Optional[PromptCache] = None,
    checkpoints: tuple = (),
    policy: Optional[DepthPolicy] = None,
    images: tuple = (),
    copy_max: int = MAX_COPY,
    pipeline: bool = True,
) -> Iterator[GenerationChunk]:
    """`copy_max`: most tokens copied from the context per round (0: the head's drafts alone);
    `pipeline`: plain rounds start the next step's pass before their token reaches the host."""
    sched = Scheduler(model, tokenizer, max_batch_size=1, prefill_chunk=None, prompt_cache=prompt_cache,
                      policy=policy or DepthPolicy(max_depth=depth, fixed=True), copy_max=copy_max,
                      pipeline=pipeline)
    sched.add(0, prompt, params, depth, checkpoints, images)  # bad input raises here, not on the first next()
    return _chunks(sched)


def _chunks(sched: Scheduler) -> Iterator[GenerationChunk]:
    while sched.has_work():
        for _, item in sched.step():
            if isinstance(item, BaseException):
                raise item
            yield item
