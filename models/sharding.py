"""Split a loaded model across the ranks of an `mx.distributed` group.

    split = Split(group, "tensor")                  # or "pipeline"
    loaded = load_model(path, split=split)          # each rank keeps (and reads) only its part

Tensor parallel is mlx-lm's own `shard` (Qwen3.5 dense and MoE): every layer's
heads and MLP are split N ways, and each layer's output is all-summed. Pipeline
parallel is mlx-lm's `pipeline`: each rank keeps a contiguous run of layers,
rank N-1 the first ones, rank 0 the last ones.

What mlx-lm's split does to the parts this project replaces:
- the GatedDeltaNet (class-swapped, `gdn.py`): `shard` divides its head counts,
  key/value/conv dims and conv groups by N and sets `sharding_group`; the
  capturing forward reads those per-rank counts, so a verify captures the rank's
  own heads' states, a commit rolls them back locally, and the output is
  all-summed as in mlx-lm's forward;
- the compiled decode layers (`compiled_steps.py`) read `q_proj`, `o_proj`, the
  MLP and the head counts off the layer: after `shard` those are the sharded
  linears (the all-sums sit inside `o_proj` / `down_proj` / the MoE block) and
  the per-rank counts, and `mx.compile` traces the collectives with the rest;
- an untied LM head is split by vocabulary and its logits gathered
  (`MTPModel.lm_head`); a tied one is the embedding, whole on every rank;
- pipeline: only `pipeline_layers` remain; `MTPModel.forward` receives the
  hidden from the previous stage, runs its layers, passes it on and shares the
  last stage's output with every rank (`PipelineStage`, as mlx-lm's forward).

The MTP head: tensor parallel, split like a backbone layer (`head="sharded"`)
or kept whole on every rank (`head="whole"`, no collective inside the head's
layer); pipeline, only on rank 0, the stage that runs the last layers.

Loading stays lazy until the split is done, so a rank reads only its part:
pipeline stages never touch other stages' layers (nor, off rank 0, the head),
and tensor-parallel ranks keep only their slices (mlx-lm's `sharded_load` does
the same).

Qwen3-Next: pipeline parallel (mlx-lm's `pipeline`); mlx-lm 0.32.2 has no `shard`
for it, so tensor parallel is refused with a message.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .mlx_lm_compat import mlx_lm_version, shard_decoder_layers

PARALLEL_MODES = ("tensor", "pipeline")
HEAD_MODES = ("whole", "sharded")


class ShardingError(ValueError):
    """The model cannot be split this way; the message says why and what works."""


def check_tensor_parallel(args: Any, n: int) -> None:
    """Every size `shard` divides must divide by n (its own asserts come too late and say less)."""
    sizes = {
        "num_attention_heads": args.num_attention_heads,
        "linear_num_key_heads": args.linear_num_key_heads,
        "linear_num_value_heads": args.linear_num_value_heads,
    }
    if args.num_experts > 0:
        sizes["moe_intermediate_size"] = args.moe_intermediate_size
        sizes["shared_expert_intermediate_size"] = args.shared_expert_intermediate_size
    else:
        sizes["intermediate_size"] = args.intermediate_size
    if not args.tie_word_embeddings:
        sizes["vocab_size"] = args.vocab_size
    bad = [f"{k} {v}" for k, v in sizes.items() if v % n]
    kv = args.num_key_value_heads
    if kv % n and n % kv:  # fewer KV heads than ranks are repeated; they must split evenly either way
        bad.append(f"num_key_value_heads {kv}")
    if bad:
        raise ShardingError(
            f"tensor parallel over {n} ranks splits every layer's heads and MLP {n} ways, but this model's "
            f"{', '.join(bad)} {'is' if len(bad) == 1 else 'are'} not divisible by {n}; "
            f"use --parallel pipeline, or a number of ranks that divides them"
        )


class PipelineStage:
    """One rank's place in mlx-lm's pipeline: rank r takes its input from rank r+1
    (rank N-1 starts from the embeddings), hands its output to rank r-1, and rank
    0's output (the last layer's) is shared with every rank."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size

    def receive(self, h: mx.array) -> mx.array:
        if self.rank < self.size - 1:
            h = mx.distributed.recv_like(h, self.rank + 1)
        return h

    def pass_on(self, h: mx.array) -> mx.array:
        if self.rank != 0:
            h = mx.distributed.send(h, self.rank - 1)
        return mx.distributed.all_gather(h)[: h.shape[0]]


def pipeline_stage(inner: nn.Module) -> Optional[PipelineStage]:
    """The stage of a model split by mlx-lm's `pipeline`, or None."""
    size = getattr(inner, "pipeline_size", 1)
    return PipelineStage(inner.pipeline_rank, size) if size > 1 else None


def local_layers(inner: nn.Module) -> list:
    """The decoder layers this rank runs (all of them unless pipelined)."""
    return getattr(inner, "pipeline_layers", inner.layers)


@dataclass
class Split:
    group: Any  # mx.distributed.Group
    mode: str = "tensor"  # PARALLEL_MODES
    head: str = "whole"  # HEAD_MODES (tensor parallel only)
    layer_range: tuple = ()  # set by apply(): [start, end) of the backbone layers held
    n_layers: int = 0  # set by apply(): the backbone's layers in all
    head_held: str = ""  # set by apply(): how this rank holds the MTP head

    def __post_init__(self):
        if self.mode not in PARALLEL_MODES:
            raise ShardingError(f"--parallel must be one of {', '.join(PARALLEL_MODES)}, not {self.mode!r}")
        if self.head not in HEAD_MODES:
            raise ShardingError(f"the MTP head is split {' or '.join(HEAD_MODES)}, not {self.head!r}")

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def size(self) -> int:
        return self.group.size()

    def splits_vocabulary(self, text: nn.Module) -> bool:
        """Tensor parallel splits an untied LM head by vocabulary: each rank holds a slice."""
        return self.mode == "tensor" and not text.args.tie_word_embeddings

    def apply(self, model_type: str, model: nn.Module, text: nn.Module, head: Optional[nn.Module]) -> Optional[nn.Module]:
        """Split the (lazily loaded) model in place; returns the head this rank keeps."""
        inner = text.model
        n_layers = self.n_layers = len(inner.layers)
        if self.mode == "tensor":
            if not hasattr(model, "shard"):  # Qwen3-Next in mlx-lm 0.32.2
                raise ShardingError(f"{model_type}: mlx-lm {mlx_lm_version} has no tensor-parallel split for this "
                                    f"model; use --parallel pipeline")
            check_tensor_parallel(text.args, self.size)
            model.shard(self.group)
            self.layer_range = (0, n_layers)
            if head is not None and self.head == "sharded":
                shard_decoder_layers(head.layers, self.group)
            self.head_held = "none" if head is None else ("sharded" if self.head == "sharded" else "whole")
            return head
        if not hasattr(inner, "pipeline"):
            raise ShardingError(f"{model_type}: mlx-lm {mlx_lm_version} has no pipeline split for this model")
        if n_layers < self.size:
            raise ShardingError(f"pipeline parallel over {self.size} ranks needs at least {self.size} layers; "
                                f"this model has {n_layers}")
        inner.pipeline(self.group)
        self.layer_range = (inner.start_idx, inner.end_idx)
        keep = head if self.rank == 0 else None
        self.head_held = "whole" if keep is not None else "none"
        return keep

    def describe(self, model: nn.Module, head: Optional[nn.Module]) -> dict:
        """What this rank holds, for the start-up report."""
        nbytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
        if head is not None:
            nbytes += sum(v.nbytes for _, v in tree_flatten(head.parameters()))
        a, b = self.layer_range
        if self.mode == "tensor":
            layers = f"layers {a}-{b - 1}, 1/{self.size} of each layer's heads and MLP"
        else:
            layers = f"layers {a}-{b - 1} of {self.n_layers}"
        return {"rank": self.rank, "host": socket.gethostname(), "pid": os.getpid(), "layers": layers,
                "mtp_head": self.head_held + (f" (1/{self.size})" if self.head_held == "sharded" else ""),
                "bytes": nbytes}


def report_lines(parts: List[dict]) -> List[str]:
    """The start-up report, one line per rank."""
    return [f"rank {p['rank']} on {p['host']} (pid {p['pid']}): {p['layers']}; MTP head: {p['mtp_head']}; "
            f"{p['bytes'] / 2**20:.1f} MiB of weights" for p in parts]
