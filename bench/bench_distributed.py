"""Serving across ranks on one machine: the same model on 1, 2 and 4 local ranks
(mlx.launch, ring backend over loopback), tensor and pipeline parallel, plain
and MTP decoding.

    python bench/bench_distributed.py                      # synthetic model that splits 4 ways
    python bench/bench_distributed.py --model demo --ranks 1 2 --tokens 96

Per configuration, rank 0 runs the engine as mtp-serve does (`engine/distributed.py`:
the other ranks follow it) on one stream at a fixed depth, alternating plain and
MTP requests, and reports:
- decode tok/s (best of the repeats and of the passes over all configurations:
  interference only adds time);
- per round: the model's collectives (counted on rank 0 in one round run
  uncompiled, where every collective is a Python call), their payload bytes, and
  the control messages (`Link`) with their bytes and time;
- time in communication per round: control messages as measured, plus the
  model's collectives replayed alone (rank 0's sequence of one round, chained
  like the model chains them, on every rank at once, no compute between them).

Then, on paper: the same collective counts for a large model, and the time per
round they would take on a 10 GbE or Thunderbolt link, against that model's
compute per round on one machine (the budget). The link figures are stated in
the output; change them with --paper-*.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, median_seconds, pc, write_json  # noqa: E402  (sets up the backend before mlx)

import mlx.core as mx  # noqa: E402

PROMPT = [5, 17, 99, 3, 42, 7, 250, 11, 64, 12, 300, 8]
BENCH_CONFIG = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=8,
                    num_key_value_heads=4, head_dim=32, linear_num_key_heads=4, linear_num_value_heads=8,
                    linear_key_head_dim=32, linear_value_head_dim=32, vocab_size=2048, full_attention_interval=4)
CONTROL = mx.uint8  # the Link's messages are byte buffers; the model's tensors are floats


# ---------------------------------------------------------------- counting the model's collectives


class Recorder:
    """Wraps mx.distributed's collectives and keeps (op, shape, dtype) of the model's
    calls since `reset()` (one round: reset when the round starts drafting)."""

    OPS = ("all_sum", "all_gather", "send", "recv_like")

    def __init__(self):
        self.ops, self._real = [], {}

    def install(self):
        for name in self.OPS:
            real = self._real[name] = getattr(mx.distributed, name)

            def wrapped(x, *a, _name=name, _real=real, **kw):
                if x.dtype != CONTROL:
                    self.ops.append((_name, list(x.shape), str(x.dtype).split(".")[-1]))
                return _real(x, *a, **kw)

            setattr(mx.distributed, name, wrapped)

    def uninstall(self):
        for name, real in self._real.items():
            setattr(mx.distributed, name, real)


def payload(ops) -> int:
    return sum(int(mx.zeros(shape, getattr(mx, dtype)).nbytes) for _, shape, dtype in ops)


def replay(ops, mode: str, rank: int, size: int, reps: int = 21) -> float:
    """Seconds per round (median) for rank 0's collectives of one round, alone. Tensor parallel:
    every rank replays that sequence (all ranks run the same one). Pipeline: each of
    rank 0's receives stands for one pipeline pass (every stage hands on, then the
    last stage's output is shared)."""
    def round_once():
        prev = None
        for name, shape, dtype in ops:
            if mode == "pipeline" and name != "recv_like":
                continue
            x = mx.ones(shape, getattr(mx, dtype))
            if prev is not None:  # chained, as each layer waits for the previous one
                x = x + 0 * prev.reshape(-1)[:1].astype(x.dtype)
            if mode == "tensor":
                prev = getattr(mx.distributed, name)(x)
            else:
                h = mx.distributed.recv_like(x, rank + 1) if rank < size - 1 else x
                if rank != 0:
                    h = mx.distributed.send(h, rank - 1)
                prev = mx.distributed.all_gather(h)
        if prev is not None:
            mx.eval(prev)

    return median_seconds(round_once, reps)


# ---------------------------------------------------------------- one configuration (every rank runs this)


def worker(args) -> None:
    from mtp_serve.backend import set_decode_blas_threads
    from mtp_serve.engine.distributed import Leader, Link, follow
    from mtp_serve.engine.policy import DepthPolicy
    from mtp_serve.engine.sampling import SamplingParams
    from mtp_serve.engine.scheduler import Scheduler
    from mtp_serve.models.loader import load_model
    from mtp_serve.models.sharding import Split

    group = mx.distributed.init()
    rank, size = group.rank(), group.size()
    split = Split(group, args.mode, "sharded" if args.shard_head else "whole") if size > 1 else None
    lm = load_model(args.model, split=split)
    link = Link(group) if size > 1 else None
    if size > 1:  # the ranks share this machine's cores (as mtp-serve gives them out)
        import os

        set_decode_blas_threads(max(1, (os.cpu_count() or 1) // size))
    else:  # as mtp-serve measures it for one process
        from mtp_serve.engine.warmup import calibrate_blas_threads

        calibrate_blas_threads(lm.model, lm.tokenizer)
    depths = [0, args.depth]
    recorder = Recorder()
    if rank != 0:
        follow(lm.model, lm.tokenizer, link)  # timed requests
        lm.model.compiled = None
        follow(lm.model, lm.tokenizer, link)  # the counting round
        ops = link.take("ops")
        for d in depths:
            replay(ops[str(d)], args.mode, rank, size)
        return

    def session():
        sched = Scheduler(lm.model, lm.tokenizer, max_batch_size=1, prefill_chunk=512,
                          policy=DepthPolicy(max_depth=args.depth, fixed=True))
        return Leader(sched, link, args.mode, on_fault=lambda e: None) if link else sched

    key = iter(range(1, 1 << 30))

    def run(runner, depth: int, n: int) -> dict:
        runner.add(next(key), PROMPT, SamplingParams(max_tokens=n, ignore_eos=True), depth)
        t_first, tokens, stats, before = None, 0, None, None
        while runner.has_work():
            for _, chunk in runner.step():
                if t_first is None:
                    t_first = pc()
                    before = vars(link.stats).copy() if link else {}
                tokens += len(chunk.token_ids)
                stats = chunk.stats
        elapsed = pc() - t_first
        rounds = stats.backbone_passes
        out = {"tok_s": (tokens - 1) / elapsed, "rounds": rounds, "tokens_per_round": (tokens - 1) / rounds,
               "round_ms": 1e3 * elapsed / rounds, "acceptance": stats.acceptance_rate}
        if link:
            after = vars(link.stats)
            out.update({f"control_{k}_per_round": (after[k] - before[k]) / rounds for k in before})
        return out

    runner = session()
    for d in depths:  # warm-up: kernels, caches
        run(runner, d, 12)
    results = {d: [] for d in depths}
    for _ in range(args.repeats):
        for d in depths:
            results[d].append(run(runner, d, args.tokens))
    best = {d: max(rs, key=lambda r: r["tok_s"]) for d, rs in results.items()}
    out = {"ranks": size, "mode": args.mode if size > 1 else "single", "head": "sharded" if args.shard_head else "whole",
           "by_depth": {}}
    if link:
        runner.stop()
        lm.model.compiled = None  # every collective a Python call: countable
        runner = session()
        recorder.install()
        sync = runner.sched.sync
        real_draft = sync.draft
        sync.draft = lambda *a: (recorder.ops.clear(), real_draft(*a))[1]  # a round starts
        per_round = {}
        for d in depths:
            run(runner, d, 8)
            per_round[str(d)] = list(recorder.ops)
        recorder.uninstall()
        runner.stop()
        link.send(ops=per_round)
        for d in depths:
            ops = per_round[str(d)]
            best[d].update({"collectives_per_round": len(ops), "payload_bytes_per_round": payload(ops),
                            "collective_ops": sorted({f"{n}{tuple(s)}" for n, s, _ in ops}),
                            "comm_ms_per_round": 1e3 * replay(ops, args.mode, rank, size)})
    for d in depths:
        out["by_depth"][str(d)] = best[d]
    print("BENCH " + json.dumps(out), flush=True)


# ---------------------------------------------------------------- the driver


def launch(args, ranks: int, mode: str) -> dict:
    """One configuration; `mode` is tensor, tensor-sharded-head or pipeline."""
    from mtp_serve.testing.launch import launch_command, run_launched

    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", "--model", args.model,
            "--mode", mode.split("-")[0], "--depth", str(args.depth), "--tokens", str(args.tokens),
            "--repeats", str(args.repeats)]
    if mode == "tensor-sharded-head":
        argv.append("--shard-head")
    command = argv if ranks == 1 else launch_command(ranks, argv)
    t0 = time.time()
    proc = run_launched(command, args.timeout)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("BENCH ")]
    if not lines:
        errors = [l for l in (proc.stderr + proc.stdout).splitlines() if "Error:" in l]
        raise RuntimeError(errors[-1] if errors else f"no result (exit {proc.returncode}): {proc.stderr[-2000:]}")
    result = json.loads(lines[-1][len("BENCH "):])
    result["wall_s"] = round(time.time() - t0, 1)
    return result


def model_path(spec: str, tmp: Path) -> str:
    if spec == "demo":
        from mtp_serve.models.demo_model import default_model_path

        return str(default_model_path())
    if spec == "synthetic":
        from mtp_serve.testing.synthetic import write_synthetic_checkpoint

        return str(write_synthetic_checkpoint(tmp / "bench-model", "qwen3_5", agreeable=True, **BENCH_CONFIG))
    return spec


def table(results, depth: int) -> list:
    base = next(r for r in results if r["ranks"] == 1)["by_depth"]["0"]["tok_s"]
    rows = ["| ranks | parallel | depth | decode tok/s | vs 1 rank plain | tokens/round | round ms | model collectives/round "
            "| model payload KiB/round | KiB/token | control msgs/round | control bytes/round | control ms/round "
            "| model comm ms/round (replayed) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for d in ("0", str(depth)):
            b = r["by_depth"][d]
            if r["ranks"] == 1:
                comm = ["-"] * 7
            else:
                kib = b["payload_bytes_per_round"] / 1024
                comm = [f"{b['collectives_per_round']}", f"{kib:.1f}", f"{kib / b['tokens_per_round']:.1f}",
                        f"{b['control_messages_per_round']:.2f}", f"{b['control_bytes_per_round']:.0f}",
                        f"{1e3 * b['control_seconds_per_round']:.2f}", f"{b['comm_ms_per_round']:.2f}"]
            mode = r["mode"] + (" (MTP head split)" if r["mode"] == "tensor" and r["head"] == "sharded" else "")
            rows.append(f"| {r['ranks']} | {mode} | {d} | {b['tok_s']:.1f} | {b['tok_s'] / base:.2f}x | "
                        f"{b['tokens_per_round']:.2f} | {b['round_ms']:.1f} | " + " | ".join(comm) + " |")
    return rows


def link_time(mode: str, T: int, depth: int, args, latency_s: float, bandwidth: float) -> tuple:
    """(collectives, payload bytes, seconds) of one round between 2 ranks for the large model
    on paper: the pattern measured here (per forward: tensor parallel 2 all-sums of [T, H] per
    layer plus the gather of a vocabulary-split LM head; pipeline one hand-off of [T, H] and one
    all-gather of it), and the control messages per round. A 2-rank ring all-sum is 2 hops of
    half the data, an all-gather or a hand-off 1 hop."""
    H, L, V, nb = args.paper_hidden, args.paper_layers, args.paper_vocab, args.paper_bytes
    size = T * H * nb
    if mode == "tensor":
        logits = T * V // 2 * nb
        n, payload = 2 * L + 1, 2 * L * size + logits
        seconds = 2 * L * (2 * latency_s + size / bandwidth) + latency_s + logits / bandwidth
        control = 3 if depth else 1
    else:
        n, payload = 2, 2 * size
        seconds = 2 * (latency_s + size / bandwidth)
        control = 2 if depth else 1
    seconds += control * (2 * latency_s + 4096 / bandwidth)  # each a ring all-sum of one 4 KiB slot
    return n + control, payload, seconds


def on_paper(args) -> list:
    """What a 10 GbE or Thunderbolt link would cost per round for a large model."""
    links = {"10 GbE, TCP ring": (args.paper_10gbe_latency_us, args.paper_10gbe_gbps),
             "Thunderbolt bridge, TCP ring": (args.paper_tb_latency_us, args.paper_tb_gbps)}
    a, K = args.paper_acceptance, args.depth
    per_round = sum(a ** j for j in range(K + 1))  # expected tokens per round at depth K
    rows = [f"On paper, 2 machines: {args.paper_layers} layers, hidden {args.paper_hidden}, vocabulary "
            f"{args.paper_vocab} (untied, split), {args.paper_bytes}-byte activations (Qwen3.6-27B's shapes), "
            f"{args.paper_step_ms:g} ms per decode step on one machine; MTP depth {K} at acceptance {a:g} per "
            f"position = {per_round:.2f} tokens per round. Link figures are assumptions, stated per row. Budget: "
            f"tensor parallel beats one machine only while the link costs less per round than the compute it "
            f"saves, about half a step ({args.paper_step_ms / 2:g} ms); pipeline parallel saves no compute per "
            f"token (it buys memory), so its link time is pure overhead on top of one step.",
            "",
            "| link | latency per hop | bandwidth | parallel | decoding | collectives/round (model + control) "
            "| payload/round | link time/round | link time/token | of a one-machine step |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for name, (lat_us, gbps) in links.items():
        for mode in ("tensor", "pipeline"):
            for depth, tokens in ((0, 1.0), (K, per_round)):
                n, payload, secs = link_time(mode, depth + 1, depth, args, lat_us * 1e-6, gbps * 1e9 / 8)
                rows.append(f"| {name} | {lat_us:g} µs | {gbps:g} Gb/s | {mode} | {'plain' if not depth else f'MTP {depth}'} "
                            f"| {n} | {payload / 1024:.0f} KiB | {1e3 * secs:.2f} ms | {1e3 * secs / tokens:.2f} ms "
                            f"| {100 * 1e3 * secs / tokens / args.paper_step_ms:.0f}% |")
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="tensor", help=argparse.SUPPRESS)
    p.add_argument("--model", default="demo", help="'demo' (trained head; tensor parallel up to 2 ranks), "
                   "'synthetic' (random, splits 4 ways), or a checkpoint path")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--modes", nargs="+", default=["tensor", "tensor-sharded-head", "pipeline"],
                   choices=["tensor", "tensor-sharded-head", "pipeline"])
    p.add_argument("--depth", type=int, default=3, help="MTP depth of the MTP requests (fixed)")
    p.add_argument("--shard-head", action="store_true", help=argparse.SUPPRESS)  # worker: split the MTP head too
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="requests per depth in each launch (best kept)")
    p.add_argument("--passes", type=int, default=2, help="launches of every configuration, interleaved (best kept)")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--paper-layers", type=int, default=64, help="the large model on paper (Qwen3.6-27B: 64 layers)")
    p.add_argument("--paper-hidden", type=int, default=5120)
    p.add_argument("--paper-vocab", type=int, default=248320)
    p.add_argument("--paper-bytes", type=int, default=2, help="bytes per activation value (bf16)")
    p.add_argument("--paper-step-ms", type=float, default=49.0,
                   help="its decode step on one machine (about 20.4 tok/s, 4-bit, mlx-lm PR #990's comment)")
    p.add_argument("--paper-acceptance", type=float, default=0.8, help="per draft position")
    p.add_argument("--paper-10gbe-latency-us", type=float, default=50.0, help="one-way, per hop (kernel TCP)")
    p.add_argument("--paper-10gbe-gbps", type=float, default=10.0)
    p.add_argument("--paper-tb-latency-us", type=float, default=200.0,
                   help="one-way, per hop; exo issue #2295 measured 0.38-0.95 ms round trips over the Thunderbolt bridge")
    p.add_argument("--paper-tb-gbps", type=float, default=20.0)
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if 1 not in args.ranks:  # checked before minutes of launches, not after them in the table
        p.error("--ranks must include 1: every figure is compared with one rank's plain decoding")
    with tempfile.TemporaryDirectory() as tmp:
        args.model = model_path(args.model, Path(tmp))
        best: dict = {}  # per configuration and depth, the fastest pass (load on the machine only slows)
        for n in range(args.passes):
            for ranks in args.ranks:
                for mode in (["single"] if ranks == 1 else args.modes):
                    print(f"... pass {n + 1}: {ranks} rank(s), {mode}", file=sys.stderr, flush=True)
                    try:
                        r = launch(args, ranks, "tensor" if mode == "single" else mode)
                    except Exception as e:  # noqa: BLE001 - e.g. a model that does not split this way
                        print(f"    skipped: {str(e).splitlines()[0][:300]}", file=sys.stderr)
                        continue
                    print(json.dumps(r), file=sys.stderr, flush=True)
                    kept = best.setdefault((ranks, mode), r)
                    for d, b in r["by_depth"].items():
                        if b["tok_s"] > kept["by_depth"][d]["tok_s"]:
                            kept["by_depth"][d] = b
        results = list(best.values())
    print("\n".join(table(results, args.depth)))
    print()
    print("\n".join(on_paper(args)))
    if args.json:
        write_json(args.json, {"environment": environment(sys.argv), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
