"""Decode speed: mlx-lm plain vs this project's plain and MTP paths vs MTPLX; and a cost model.

    python bench/bench_speed.py [--model DIR] [--max-tokens 128] [--prompts 8] [--depths 1 2 3 4]
                                [--json PATH] [--skip-mtplx]
    python bench/bench_speed.py --cost-model [--json PATH]

Decode mode (default). On the same held-out code prompts, greedy, each mode
once per prompt in round-robin order (rotated per prompt, to spread machine
noise over the modes), after one untimed warm-up run per mode:

* `mlx-lm plain`: `mlx_lm.generate.generate_step` on a stock `mlx_lm.load`
  model cast to fp32 (the reference every speedup is a ratio to), OpenBLAS on
  every core as in any process that leaves it alone;
* `mlx-lm plain 1thr`: the same with OpenBLAS on one thread, the setting this
  project picks for decode-sized matmuls (so the gain of that choice alone shows);
* `ours plain`: this project's generator at depth 0;
* `ours mtp dK`: this project's MTP path at each depth K of `--depths`;
* `mtplx ...`: MTPLX (PyPI `mtplx`, the strongest MLX peer; not a dependency
  of this project: `pip install --no-deps mtplx`) on the same checkpoint cast
  to fp32, plain (`generate_ar`) and MTP (`generate_mtpk`) at each depth with
  the settings its own server passes (`--mtplx-config server`: capture_commit
  verify, conv-tape GDN verify core, committed head history; `library` keeps
  generate_mtpk's slower keyword defaults), in a separate worker process (its
  load patches mlx-lm classes; a separate process keeps those patches away
  from the other modes), imported through `bench/mtplx_shim.py`. When it
  cannot run, its row carries the error.

Per mode: decode tokens/s (tokens after the first / time from the first to the
last token, so prefill is excluded), time to first token, acceptance per draft
position, tokens per backbone pass, and whether the greedy token ids equal
mlx-lm's (for a divergence: the index and mlx-lm's top-two logit gap there; a
gap under 1e-4 is a near-tie, anything else is a bug). Then one profiled run
per path splits a round's wall time into draft / verify / commit / the rest
(sampling, acceptance, host syncs, Python), with every piece `mx.eval`'d
(the syncs make the instrumented round a little slower than the real one),
and the measured verify/draft cost ratios of the benchmarked model itself.

Cost-model mode (`--cost-model`): random weights, fp32, with Qwen3.5-0.8B's
layer shapes (all 24 layers; vocabulary reduced to 32k to save memory) and a
Qwen3.5-9B-like shape (hidden 4096, 4 of its 32 layers built), plus the
`--model` checkpoint when it loads: cost of a T-token verify forward (GDN state
capture on) plus its commit relative to a plain one-token step for T = 1..5, and of one MTP
draft step. Because the LM head and the layer count are cut, each shape also
gets a projected full-model row: layers scaled to the real layer count and
the LM head re-timed at the real vocabulary (248,320) as a plain matmul. The
predicted speedup for acceptance a at depth K is E/cost, E = sum_{j=0..K} a^j,
cost = verify(K+1) + K * draft (both relative to one plain step).
"""

from __future__ import annotations

import mtp_serve  # noqa: F401  (before mlx.core: OpenBLAS preload, fp32 on CPU)

import argparse
import gc
import json
import math
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

from mtp_serve import BACKEND
from mtp_serve.backend import set_blas_threads
from mtp_serve.engine.generator import generate
from mtp_serve.engine.sampling import SamplingParams
from mtp_serve.models.caches import SpeculativeGDNCache, commit_verify, set_capture

REPO = Path(__file__).resolve().parents[1]
BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_JSON = REPO / "bench" / "results" / "bench_speed.json"
NEAR_TIE = 1e-4
ACCEPTANCES = (0.5, 0.7, 0.8, 0.9)
QWEN35_VOCAB = 248320
pc = time.perf_counter


def fp32(model) -> None:
    model.update(tree_map(lambda x: x.astype(mx.float32) if mx.issubdtype(x.dtype, mx.floating) else x, model.parameters()))


def one_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}"[:300]


# --------------------------------------------------------------------------- prompts


def load_prompts(model_dir: Path, tokenizer, n: int, length: int) -> tuple[list[tuple[str, list[int]]], str]:
    """Held-out code prompts: demo_acceptance's source when it applies, else stdlib files."""
    src = Path(os.__file__).parent
    if (model_dir / "heldout_files.json").exists():
        try:
            sys.path.insert(0, str(BENCH_DIR))
            from demo_acceptance import heldout_prompts

            prompts = heldout_prompts(model_dir, tokenizer, n, length, src)
            if len(prompts) >= min(n, 1):
                return prompts, "bench/demo_acceptance.py heldout_prompts (files held out of the demo model's training)"
        except Exception as e:  # fall back to plain stdlib text
            print(f"note: demo_acceptance prompts unavailable ({one_line(e)}); using stdlib files", file=sys.stderr)
    files = sorted(p for p in src.glob("*.py") if p.stat().st_size > 8000)
    out = []
    step = max(1, len(files) // max(n, 1))
    for p in files[::step]:
        ids = tokenizer.encode(p.read_text(encoding="utf-8", errors="replace"), add_special_tokens=False)
        if len(ids) < length + 16:
            continue
        start = min(len(ids) // 3, len(ids) - length - 1)
        out.append((p.name, ids[start : start + length]))
        if len(out) == n:
            break
    return out, f"Python stdlib files ({src}), {length} tokens from a third of the way in (not known to be held out)"


# --------------------------------------------------------------------------- runs


@dataclass
class RunResult:
    tokens: List[int]
    ttft_s: float
    decode_s: float  # first to last token
    extra: Dict[str, Any] = field(default_factory=dict)

    @property
    def decode_tok_s(self) -> float:
        return (len(self.tokens) - 1) / self.decode_s if self.decode_s > 0 else 0.0


class Mode:
    name: str = ""
    kind: str = ""  # mlx-lm | ours | mtplx
    depth: int = 0
    error: Optional[str] = None

    def run(self, prompt: List[int], n: int) -> RunResult:
        raise NotImplementedError


class MlxLmPlain(Mode):
    """Stock mlx-lm decoding. OpenBLAS runs on every core, as it does in a process
    that never changes it (`blas_threads=1`: the thread count this project
    picks for decode, to show how much of a speedup that choice alone is)."""

    kind = "mlx-lm"

    def __init__(self, model, blas_threads: Optional[int] = None):
        self.model, self.blas_threads = model, blas_threads
        self.name = "mlx-lm plain" if blas_threads is None else f"mlx-lm plain {blas_threads}thr"

    def run(self, prompt, n):
        from mlx_lm.generate import generate_step

        set_blas_threads(self.blas_threads)
        toks, t_first, t_last = [], None, None
        t0 = pc()
        for tok, _ in generate_step(mx.array(prompt), self.model, max_tokens=n):
            toks.append(int(tok))
            t_last = pc()
            if t_first is None:
                t_first = t_last
        mx.synchronize()  # generate_step leaves one step in flight: keep it out of the next run
        return RunResult(toks, t_first - t0, t_last - t_first)


class OursMode(Mode):
    kind = "ours"

    def __init__(self, lm, depth: int):
        self.lm, self.depth = lm, depth
        self.name = "ours plain" if depth == 0 else f"ours mtp d{depth}"

    def run(self, prompt, n):
        params = SamplingParams(max_tokens=n, ignore_eos=True)
        toks, stats, t_first, t_last = [], None, None, None
        t0 = pc()
        for chunk in generate(self.lm.model, self.lm.tokenizer, prompt, params, self.depth):
            t_last = pc()
            if t_first is None:
                t_first = t_last
            toks += chunk.token_ids
            stats = chunk.stats
        s = stats.as_dict()
        extra = {k: s[k] for k in ("backbone_passes", "drafted_per_position", "accepted_per_position", "tokens_per_pass")}
        return RunResult(toks, t_first - t0, t_last - t_first, extra)


# ---- MTPLX, in its own process


# generate_mtpk's keyword defaults are a conservative path (batched verify that
# restores a snapshot and re-forwards on every reject, no head history over the
# prompt); MTPLX's own server passes these instead (mtplx/server/openai.py and
# its --verify-strategy / --verify-core defaults), and they are much faster.
MTPLX_CONFIGS = {
    "server": dict(verify_strategy="capture_commit", verify_core="linear-gdn-from-conv-tape",
                   mtp_history_policy="committed", mtp_hidden_variant="post_norm", mtp_cache_policy="persistent"),
    "library": {},
}


def _mtplx_worker(conn, model_path: str, config: str = "server") -> None:
    """Loads MTPLX and serves ("run", prompt, n, depth) requests over `conn`."""
    try:
        sys.path.insert(0, str(BENCH_DIR))
        import mtplx_shim

        mtplx = mtplx_shim.import_mtplx()
        from mtplx.generation import generate_ar, generate_mtpk
        from mtplx.runtime import load
        from mtplx.sampling import SamplerConfig

        rt = load(model_path)
        dtypes_before = sorted({str(v.dtype) for _, v in tree_flatten(rt.model.parameters())})
        fp32(rt.model)
        mx.eval(rt.model.parameters())
        contract = {k: getattr(rt.contract, k, None) for k in ("base_hidden_variant", "hidden_variant", "concat_order")}
        conn.send(("ok", {"version": mtplx.__version__, "mtp_enabled": bool(rt.mtp_enabled), "contract": contract,
                          "checkpoint_dtypes": dtypes_before, "shim": "bench/mtplx_shim.py (route_tape libSystem CDLL)"}))
    except BaseException as e:  # noqa: BLE001  (report, never crash the harness)
        conn.send(("error", one_line(e), traceback.format_exc()))
        return
    greedy = SamplerConfig(temperature=0.0, top_p=1.0, top_k=0)
    while True:
        msg = conn.recv()
        if msg[0] == "quit":
            return
        _, prompt, n, depth = msg
        try:
            times: List[float] = []
            cb_tokens: List[int] = []

            def cb(toks):
                times.append(pc())
                cb_tokens.extend(int(t) for t in toks)

            t0 = pc()
            kw = dict(max_tokens=n, sampler=greedy, stop_token_ids=set(), token_callback=cb)
            if depth == 0:
                out = generate_ar(rt, list(prompt), **kw)
            else:
                out = generate_mtpk(rt, list(prompt), speculative_depth=depth, **MTPLX_CONFIGS[config], **kw)
            st = out.stats
            extra = {"mtplx_decode_tok_s": st.decode_tok_s}
            if depth:
                drafted = list(getattr(st, "drafted_by_depth", []) or [])
                accepted = list(getattr(st, "accepted_by_depth", []) or [])
                calls = int(getattr(st, "verify_calls", 0) or 0)
                extra.update(drafted_per_position=drafted, accepted_per_position=accepted, backbone_passes=calls,
                             tokens_per_pass=round((len(out.tokens) - 1) / calls, 4) if calls else 0.0)
            conn.send(("ok", dict(tokens=[int(t) for t in out.tokens], ttft_s=times[0] - t0,
                                  decode_s=times[-1] - times[0], extra=extra)))
        except BaseException as e:  # noqa: BLE001
            conn.send(("error", one_line(e), traceback.format_exc()))


class MtplxWorker:
    def __init__(self, model_path: str, timeout_s: float, config: str = "server"):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_mtplx_worker, args=(child, model_path, config), daemon=True)
        self.proc.start()
        self.timeout_s = timeout_s
        self.info: Dict[str, Any] = {}
        reply = self._recv(600)
        if reply[0] != "ok":
            self.close()
            raise RuntimeError(reply[1] + ("\n" + reply[2] if len(reply) > 2 else ""))
        self.info = reply[1]

    def _recv(self, timeout):
        if not self.conn.poll(timeout):
            raise TimeoutError(f"MTPLX worker gave no answer in {timeout:.0f}s")
        return self.conn.recv()

    def run(self, prompt, n, depth) -> RunResult:
        if not self.proc.is_alive():
            raise RuntimeError(f"MTPLX worker died (exit code {self.proc.exitcode})")
        self.conn.send(("run", list(prompt), n, depth))
        try:
            reply = self._recv(self.timeout_s)
        except EOFError:
            raise RuntimeError(f"MTPLX worker died (exit code {self.proc.exitcode})") from None
        if reply[0] != "ok":
            raise RuntimeError(reply[1])
        return RunResult(**reply[1])

    def close(self):
        try:
            if self.proc.is_alive():
                self.conn.send(("quit",))
                self.proc.join(10)
        except Exception:
            pass
        if self.proc.is_alive():
            self.proc.terminate()


class MtplxMode(Mode):
    kind = "mtplx"

    def __init__(self, worker: Optional[MtplxWorker], depth: int, error: Optional[str] = None):
        self.worker, self.depth, self.error = worker, depth, error
        self.name = "mtplx plain" if depth == 0 else f"mtplx mtp d{depth}"

    def run(self, prompt, n):
        return self.worker.run(prompt, n, self.depth)


# --------------------------------------------------------------------------- profiling


class Instrument:
    """Times every MTPModel.forward / draft call and the commit, each `mx.eval`'d.

    Patches only this process's objects, only inside the `with` block: the
    model instance's `forward`/`draft` and the engine's `commit_verify`.
    """

    def __init__(self, model):
        self.model = model
        self.times: Dict[str, float] = {"draft": 0.0, "verify": 0.0, "plain_forward": 0.0, "commit": 0.0}
        self.calls: Dict[str, int] = {k: 0 for k in self.times}

    def _add(self, key, dt):
        self.times[key] += dt
        self.calls[key] += 1

    def __enter__(self):
        import mtp_serve.engine.speculative as spec

        m, inst = self.model, self
        orig_forward, orig_draft = m.forward, m.draft

        def forward(tokens, cache):
            t = pc()
            h, logits = orig_forward(tokens, cache)
            captured = [c.window.arrays for c in cache if isinstance(c, SpeculativeGDNCache) and c.capturing and c.window is not None]
            mx.eval(h, logits, captured)
            T = tokens.shape[1]
            # prefill (long inputs) is not a decode step: leave it out
            if T <= 8:
                inst._add("verify" if captured else "plain_forward", pc() - t)
            return h, logits

        def draft(hidden, next_tokens, head_cache):
            t = pc()
            out = orig_draft(hidden, next_tokens, head_cache)
            mx.eval(out)
            inst._add("draft", pc() - t)
            return out

        m.forward, m.draft = forward, draft
        self._spec = spec
        self._orig_commit = getattr(spec, "commit_verify", None)
        if self._orig_commit is not None:
            orig_commit = self._orig_commit

            def commit(cache, accepted_tokens, verified_tokens):
                t = pc()
                orig_commit(cache, accepted_tokens=accepted_tokens, verified_tokens=verified_tokens)
                mx.eval([c.state for c in cache])
                inst._add("commit", pc() - t)

            spec.commit_verify = commit
        return self

    def __exit__(self, *exc):
        del self.model.forward, self.model.draft  # back to the class methods
        if self._orig_commit is not None:
            self._spec.commit_verify = self._orig_commit
        return False


def profile_path(lm, prompt, n, depth) -> dict:
    """One instrumented generation: where a round's wall time goes."""
    with Instrument(lm.model) as ins:
        params = SamplingParams(max_tokens=n, ignore_eos=True)
        t_first = None
        stats = None
        for chunk in generate(lm.model, lm.tokenizer, prompt, params, depth):
            if t_first is None:
                t_first = pc()
                for k in ins.times:  # prefill (and its head pass) excluded
                    ins.times[k], ins.calls[k] = 0.0, 0
            stats = chunk.stats
        wall = pc() - t_first
    rounds = stats.backbone_passes
    per_round = {k: 1e3 * v / rounds for k, v in ins.times.items() if ins.calls[k]}
    per_round["other"] = 1e3 * wall / rounds - sum(per_round.values())
    return {
        "depth": depth,
        "rounds": rounds,
        "tokens": stats.generated_tokens,
        "round_ms": round(1e3 * wall / rounds, 3),
        "per_round_ms": {k: round(v, 3) for k, v in per_round.items()},
        "calls": {k: v for k, v in ins.calls.items() if v},
        "tokens_per_round": round((stats.generated_tokens - 1) / rounds, 3),
        "instrumented_tok_s": round((stats.generated_tokens - 1) / wall, 2),
    }


# --------------------------------------------------------------------------- cost model


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def measure_costs(model, *, context: int = 128, reps: int = 5, Ts=(1, 2, 3, 4, 5), seed: int = 0,
                  full_vocab: Optional[int] = None, log=print) -> dict:
    """Median seconds of: a plain T=1 step, a T-token verify (capture on) and its commit, one draft step,
    and the model's LM head alone over T rows (and at `full_vocab` as a plain matmul)."""
    V = model.vocab_size
    H = model.inner.embed_tokens.weight.shape[1]
    key = mx.random.key(seed)
    cache, head_cache = model.make_cache(), model.make_head_cache()
    prompt = mx.random.randint(0, V, (1, context), key=key)
    hidden, _ = model.forward(prompt, cache)
    if model.has_mtp:
        model.draft(hidden[:, :-1], prompt[:, 1:], head_cache)
    mx.eval(hidden, [c.state for c in cache], head_cache.state if model.has_mtp else [])
    h_last = hidden[:, -1:]
    W_full = None
    if full_vocab and full_vocab != V:
        W_full = mx.random.normal((full_vocab, H), key=mx.random.key(seed + 1)) * 0.02
        mx.eval(W_full)
    tok = lambda T: mx.random.randint(0, V, (1, T))  # noqa: E731

    def plain():
        x = tok(1)
        mx.eval(x)
        t = pc()
        h, lg = model.forward(x, cache)
        mx.eval(h, lg, [c.state for c in cache])
        return pc() - t

    def verify(T):
        x = tok(T)
        mx.eval(x)
        set_capture(cache, True)
        t = pc()
        h, lg = model.forward(x, cache)
        set_capture(cache, False)
        commit_verify(cache, accepted_tokens=1, verified_tokens=T)  # the commit's state is part of the cost
        mx.eval(h, lg, [c.state for c in cache])
        return pc() - t

    def draft():
        x = tok(1)
        mx.eval(x)
        t = pc()
        out = model.draft(h_last, x, head_cache)
        mx.eval(out)
        dt = pc() - t
        head_cache.trim(1)
        return dt

    def head(T, W=None):
        x = mx.random.normal((1, T, H))
        mx.eval(x)
        t = pc()
        y = model.lm_head(x) if W is None else x @ W.T
        mx.eval(y)
        return pc() - t

    res: Dict[str, List[float]] = {}
    for rep in range(reps + 1):  # rep 0: warm-up, discarded
        row = {"plain": plain()}
        for T in Ts:
            row[f"verify{T}"] = verify(T)
            row[f"lm{T}"] = head(T)
            if W_full is not None:
                row[f"lmfull{T}"] = head(T, W_full)
        if model.has_mtp:
            row["draft"] = draft()
        if rep:
            for k, v in row.items():
                res.setdefault(k, []).append(v)
    med = {k: _median(v) for k, v in res.items()}
    del W_full
    return med


def cost_ratios(med: dict, Ts=(1, 2, 3, 4, 5), layer_scale: float = 1.0, full_lm: bool = False) -> dict:
    """Costs relative to one plain step; with layer_scale/full_lm, projected to the full model.

    Projection: layers(T) = verify(T) - lm(T) scaled by layer_scale, plus the LM head
    at the full vocabulary; the draft keeps its layer part and takes the full LM head.
    """
    def lm(T):
        return med[f"lmfull{T}"] if full_lm and f"lmfull{T}" in med else med[f"lm{T}"]

    def proj(total, T):
        return (total - med[f"lm{T}"]) * layer_scale + lm(T)

    step = proj(med["plain"], 1)
    out = {"step_ms": 1e3 * step, "verify": {T: proj(med[f"verify{T}"], T) / step for T in Ts}}
    if "draft" in med:
        out["draft"] = (med["draft"] - med["lm1"] + lm(1)) / step
    return out


def predicted_speedup(ratios: dict, a: float, K: int) -> float:
    E = sum(a**j for j in range(K + 1))
    return E / (ratios["verify"][K + 1] + K * ratios["draft"])


def qwen35_08b_text(vocab: int) -> dict:
    return dict(hidden_size=1024, num_hidden_layers=24, intermediate_size=3584,
                linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
                num_attention_heads=8, num_key_value_heads=2, head_dim=256, full_attention_interval=4,
                vocab_size=vocab, tie_word_embeddings=True,
                rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                                 "mrope_section": [11, 11, 10]})


def qwen35_9b_like_text(vocab: int, layers: int) -> dict:
    return dict(hidden_size=4096, num_hidden_layers=layers, intermediate_size=12288,
                linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                num_attention_heads=16, num_key_value_heads=4, head_dim=256, full_attention_interval=4,
                vocab_size=vocab, tie_word_embeddings=True,
                rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                                 "mrope_section": [11, 11, 10]})


def random_mtp_model(text_overrides: dict):
    from mtp_serve.models.gdn import install_capturing_gdn
    from mtp_serve.models.model_card import load_card
    from mtp_serve.models.mtp_model import MTPModel
    from mtp_serve.testing.synthetic import build_random, tiny_text_config

    text = tiny_text_config("qwen3_5", **text_overrides)
    model, head, _ = build_random("qwen3_5", text)
    fp32(model)
    fp32(head)
    mx.eval(model.parameters(), head.parameters())
    install_capturing_gdn(model.language_model.model.layers)
    model.eval()
    head.eval()
    return MTPModel(model, model.language_model, head, load_card("qwen3_5"), "qwen3_5")


def n_params(m) -> int:
    return sum(v.size for _, v in tree_flatten(m.parameters()))


def run_cost_model(args) -> dict:
    shapes = []
    vocab = args.cost_vocab
    shapes.append(dict(name="Qwen3.5-0.8B shapes", text=qwen35_08b_text(vocab), real_layers=24, built_layers=24,
                       note=f"24/24 layers, hidden 1024, GDN 16k/16v heads x128, attn 8q/2kv x256, ffn 3584, vocab {vocab} (real 248,320)"))
    L = args.cost_9b_layers
    shapes.append(dict(name=f"Qwen3.5-9B-like, {L} layers", text=qwen35_9b_like_text(vocab, L), real_layers=32, built_layers=L,
                       note=f"{L}/32 layers, hidden 4096, GDN 16k/32v heads x128, attn 16q/4kv x256, ffn 12288, vocab {vocab} (real 248,320)"))
    results = []
    for s in shapes:
        t0 = pc()
        print(f"[cost] building {s['name']} ({s['note']})", flush=True)
        model = random_mtp_model(s["text"])
        n_back = n_params(model.model)
        n_head = n_params(model.head)
        med = measure_costs(model, context=args.cost_context, reps=args.cost_reps, full_vocab=QWEN35_VOCAB)
        meas = cost_ratios(med)
        proj = cost_ratios(med, layer_scale=s["real_layers"] / s["built_layers"], full_lm=True)
        results.append(dict(name=s["name"], note=s["note"], backbone_params=n_back, head_params=n_head,
                            seconds=round(pc() - t0, 1), median_s=med, measured=meas, projected=proj))
        print(f"[cost] {s['name']}: plain step {meas['step_ms']:.1f} ms, verify T=2 {meas['verify'][2]:.2f}x, "
              f"draft {meas['draft']:.3f}x ({pc() - t0:.0f}s)", flush=True)
        del model
        gc.collect()
        mx.clear_cache()
    if args.model_path is not None:
        try:
            from mtp_serve.models.loader import load_model

            t0 = pc()
            lm = load_model(str(args.model_path))
            med = measure_costs(lm.model, context=args.cost_context, reps=max(args.cost_reps, 10))
            results.append(dict(name=f"{args.model_label} (trained checkpoint)", note=str(args.model_path),
                                backbone_params=n_params(lm.model.model),
                                head_params=n_params(lm.model.head) if lm.model.has_mtp else 0,
                                seconds=round(pc() - t0, 1), median_s=med, measured=cost_ratios(med), projected=None))
        except Exception as e:
            print(f"[cost] {args.model_path}: skipped ({one_line(e)})")
    return {"shapes": results, "context": args.cost_context, "reps": args.cost_reps}


def print_cost_tables(cost: dict, depths: List[int]) -> None:
    Ts = (1, 2, 3, 4, 5)
    print()
    print(f"Cost model: fp32, {BACKEND.note}; context {cost['context']} tokens; median of {cost['reps']} reps.")
    print("Verify cost of T tokens (GDN capture on) and one MTP draft step, relative to one plain T=1 step:")
    hdr = f"{'shape':52s} {'step ms':>8s} " + " ".join(f"{'T=' + str(T):>6s}" for T in Ts) + f" {'draft':>6s}"
    print(hdr)
    print("-" * len(hdr))
    rows = []
    for s in cost["shapes"]:
        rows.append((s["name"] + " (measured)", s["measured"]))
        if s["projected"] is not None:
            rows.append((s["name"] + " -> full model", s["projected"]))
    for label, r in rows:
        print(f"{label:52s} {r['step_ms']:8.1f} " + " ".join(f"{r['verify'][T]:6.2f}" for T in Ts)
              + f" {r.get('draft', float('nan')):6.3f}")
    print("('-> full model': layers scaled to the real layer count, LM head re-timed at vocab 248,320.)")
    print()
    print("Predicted speedup over plain decoding, E/cost, E = sum_{j=0..K} a^j, cost = verify(K+1) + K*draft:")
    hdr = f"{'shape':52s} {'a':>4s} " + " ".join(f"{'K=' + str(K):>6s}" for K in depths) + "   best"
    print(hdr)
    print("-" * len(hdr))
    for label, r in rows:
        if "draft" not in r:
            continue
        for a in ACCEPTANCES:
            sp = {K: predicted_speedup(r, a, K) for K in depths if K + 1 in r["verify"]}
            best = max(sp, key=sp.get)
            print(f"{label:52s} {a:4.1f} " + " ".join(f"{sp[K]:6.2f}" for K in sp) + f"   K={best} {sp[best]:.2f}x")
            r.setdefault("predicted", {})[str(a)] = {str(K): round(v, 4) for K, v in sp.items()}


# --------------------------------------------------------------------------- decode benchmark


def reference_gap(mlx_model, prompt, index) -> float:
    """mlx-lm's top-two logit gap at output position `index` (its own greedy run)."""
    from mlx_lm.generate import generate_step

    for i, (_, lp) in enumerate(generate_step(mx.array(prompt), mlx_model, max_tokens=index + 1)):
        if i == index:
            top2 = mx.sort(lp)[-2:]
            return float(top2[1] - top2[0])
    return float("nan")


def summarize(mode: Mode, runs: List[RunResult], ref: List[List[int]], gaps: Dict) -> dict:
    dec_tokens = sum(len(r.tokens) - 1 for r in runs)
    dec_time = sum(r.decode_s for r in runs)
    out = {
        "mode": mode.name, "kind": mode.kind, "depth": mode.depth, "runs": len(runs),
        "decode_tok_s": dec_tokens / dec_time if dec_time else 0.0,
        "decode_tok_s_per_prompt": [round(r.decode_tok_s, 2) for r in runs],
        "ttft_ms_median": 1e3 * _median([r.ttft_s for r in runs]),
        "tokens": sum(len(r.tokens) for r in runs),
    }
    drafted, accepted, passes, ntok = None, None, 0, 0
    for r in runs:
        d, a = r.extra.get("drafted_per_position"), r.extra.get("accepted_per_position")
        if d:
            drafted = [x + y for x, y in zip(drafted, d)] if drafted else list(d)
            accepted = [x + y for x, y in zip(accepted, a)] if accepted else list(a)
        if r.extra.get("backbone_passes"):
            passes += r.extra["backbone_passes"]
            ntok += len(r.tokens) - 1
    if drafted:
        out["acceptance_per_position"] = [round(a / d, 4) if d else 0.0 for a, d in zip(accepted, drafted)]
        out["acceptance_overall"] = round(sum(accepted) / sum(drafted), 4)
    out["tokens_per_pass"] = round(ntok / passes, 4) if passes else (1.0 if mode.depth == 0 else None)
    same, divergences = 0, []
    for i, r in enumerate(runs):
        if r.tokens == ref[i]:
            same += 1
            continue
        j = next((k for k, (x, y) in enumerate(zip(r.tokens, ref[i])) if x != y), min(len(r.tokens), len(ref[i])))
        g = gaps.get((i, j))
        divergences.append({"prompt": i, "index": j, "ours": r.tokens[j] if j < len(r.tokens) else None,
                            "mlx_lm": ref[i][j] if j < len(ref[i]) else None, "mlx_lm_top2_gap": g,
                            "near_tie": (g is not None and g < NEAR_TIE)})
    out["identical_prompts"] = same
    out["divergences"] = divergences
    return out


def fmt_identical(s: dict) -> str:
    if s["kind"] == "mlx-lm":
        return "reference"
    txt = f"{s['identical_prompts']}/{s['runs']}"
    if s["divergences"]:
        d = s["divergences"][0]
        gap = d["mlx_lm_top2_gap"]
        txt += f" (p{d['prompt']}@{d['index']} gap {gap:.2g}{' tie' if d['near_tie'] else ''})" if gap is not None else ""
    return txt


def print_decode_table(summaries: List[dict], errors: List[dict]) -> None:
    base = next(s for s in summaries if s["kind"] == "mlx-lm")["decode_tok_s"]
    ours_plain = next((s for s in summaries if s["mode"] == "ours plain"), None)
    hdr = (f"{'mode':16s} {'tok/s':>8s} {'x mlx-lm':>9s} {'x ours':>7s} {'TTFT ms':>8s} {'tok/pass':>8s}  "
           f"{'acceptance per position':28s} identical to mlx-lm")
    print(hdr)
    print("-" * (len(hdr) + 12))
    for s in summaries:
        acc = " ".join(f"{a:.2f}" for a in s.get("acceptance_per_position", [])) or "-"
        tpp = f"{s['tokens_per_pass']:.2f}" if s.get("tokens_per_pass") else "-"
        rel = s["decode_tok_s"] / ours_plain["decode_tok_s"] if ours_plain else float("nan")
        print(f"{s['mode']:16s} {s['decode_tok_s']:8.1f} {s['decode_tok_s'] / base:8.2f}x {rel:6.2f}x "
              f"{s['ttft_ms_median']:8.1f} {tpp:>8s}  {acc:28s} {fmt_identical(s)}")
    for e in errors:
        print(f"{e['mode']:16s} {'-':>8s} {'-':>9s} {'-':>7s} {'-':>8s} {'-':>8s}  ERROR: {e['error']}")


def run_decode(args) -> dict:
    from mlx_lm import load as mlx_lm_load

    from mtp_serve.models.loader import load_model

    path = args.model_path
    t0 = pc()
    lm = load_model(str(path))
    print(f"model {path}: {lm.mtp_status}; backbone {n_params(lm.model.model):,} params"
          + (f", head {n_params(lm.model.head):,}" if lm.model.has_mtp else "") + f"; loaded in {pc() - t0:.1f}s", flush=True)
    from mtp_serve.engine.warmup import calibrate_blas_threads

    threads = calibrate_blas_threads(lm.model)  # as mtp-serve does at start-up
    print(f"decode matmuls on {threads or 'all'} OpenBLAS thread(s) for this project's paths (measured at load)")
    ref_model, _ = mlx_lm_load(str(path))
    fp32(ref_model)
    mx.eval(ref_model.parameters())

    prompts, prompt_source = load_prompts(Path(path), lm.tokenizer, args.prompts, args.prompt_tokens)
    if not prompts:
        sys.exit("no prompts could be built")
    print(f"{len(prompts)} prompts x {args.prompt_tokens} tokens from {prompt_source}; {args.max_tokens} new tokens each, greedy")

    modes: List[Mode] = [MlxLmPlain(ref_model), MlxLmPlain(ref_model, blas_threads=1), OursMode(lm, 0)]
    depths = [d for d in args.depths if d > 0] if lm.model.has_mtp else []
    modes += [OursMode(lm, d) for d in depths]
    errors: List[dict] = []
    worker = None
    mtplx_info: Dict[str, Any] = {"ran": False}
    if not args.skip_mtplx:
        try:
            t0 = pc()
            worker = MtplxWorker(str(path), timeout_s=args.mtplx_timeout, config=args.mtplx_config)
            mtplx_info.update(worker.info, ran=True, load_s=round(pc() - t0, 1), config=args.mtplx_config,
                              generate_mtpk_kwargs=MTPLX_CONFIGS[args.mtplx_config])
            print(f"MTPLX {worker.info.get('version')} loaded in a worker process (mtp_enabled={worker.info.get('mtp_enabled')}, "
                  f"checkpoint dtypes {worker.info.get('checkpoint_dtypes')}, cast to fp32; contract {worker.info.get('contract')}; "
                  f"{args.mtplx_config} settings {MTPLX_CONFIGS[args.mtplx_config]})", flush=True)
            modes.append(MtplxMode(worker, 0))
            mtplx_depths = args.mtplx_depths if args.mtplx_depths is not None else depths
            if worker.info.get("mtp_enabled"):
                modes += [MtplxMode(worker, d) for d in mtplx_depths]
            else:
                errors.append({"mode": "mtplx mtp", "error": "MTPLX loaded the checkpoint without MTP (mtp_enabled=False)"})
        except Exception as e:
            full = str(e)
            mtplx_info["error"] = full
            first = full.splitlines()[0] if full else type(e).__name__
            errors.append({"mode": "mtplx", "error": first})
            print(f"MTPLX cannot run on this model: {first}", flush=True)

    def safe_run(mode, prompt):
        try:
            return mode.run(prompt, args.max_tokens)
        except Exception as e:
            mode.error = one_line(e)
            errors.append({"mode": mode.name, "error": mode.error})
            print(f"  {mode.name}: ERROR {mode.error}", flush=True)
            return None

    print("warm-up: one run per mode", flush=True)
    for m in modes:
        t = pc()
        safe_run(m, prompts[0][1])
        print(f"  {m.name:16s} {pc() - t:6.1f}s", flush=True)

    runs: Dict[str, List[Optional[RunResult]]] = {m.name: [] for m in modes}
    load0 = os.getloadavg()
    for i, (label, prompt) in enumerate(prompts):
        active = [m for m in modes if m.error is None]
        k = i % len(active)
        order = active[k:] + active[:k]
        line = []
        for m in order:
            r = safe_run(m, prompt)
            if r is not None:
                runs[m.name].append(r)
                line.append(f"{m.name} {r.decode_tok_s:.1f}")
        print(f"prompt {i + 1}/{len(prompts)} {label}: " + ", ".join(line), flush=True)
    load1 = os.getloadavg()

    if modes[0].error is not None:
        sys.exit(f"the mlx-lm reference failed: {modes[0].error}")
    ref_runs = runs[modes[0].name]
    ref = [r.tokens for r in ref_runs]
    # mlx-lm's top-two gap at each first divergence (outside the timed runs)
    gaps: Dict = {}
    for m in modes[1:]:
        if m.error is not None:
            continue
        for i, r in enumerate(runs[m.name]):
            if r.tokens != ref[i]:
                j = next((k for k, (x, y) in enumerate(zip(r.tokens, ref[i])) if x != y), None)
                if j is not None and (i, j) not in gaps:
                    gaps[(i, j)] = reference_gap(ref_model, prompts[i][1], j)

    summaries = [summarize(m, runs[m.name], ref, gaps) for m in modes if m.error is None and len(runs[m.name]) == len(prompts)]
    base = summaries[0]["decode_tok_s"]
    for s in summaries:
        s["speedup_vs_mlx_lm"] = round(s["decode_tok_s"] / base, 4)
        s["decode_tok_s"] = round(s["decode_tok_s"], 2)
        s["ttft_ms_median"] = round(s["ttft_ms_median"], 2)

    if worker is not None:
        worker.close()

    # where the time goes: one instrumented run per path, and the model's own cost ratios
    profile: Dict[str, Any] = {}
    if not args.no_profile:
        try:
            prompt = prompts[0][1]
            profile["plain"] = profile_path(lm, prompt, args.max_tokens, 0)
            best = max((s for s in summaries if s["kind"] == "ours" and s["depth"] > 0),
                       key=lambda s: s["decode_tok_s"], default=None)
            for d in sorted({best["depth"]} if best else set()):
                profile[f"mtp_d{d}"] = profile_path(lm, prompt, args.max_tokens, d)
            med = measure_costs(lm.model, context=args.prompt_tokens, reps=10)
            profile["cost_ratios"] = cost_ratios(med)
            profile["cost_median_s"] = med
        except Exception as e:
            profile["error"] = one_line(e)
            traceback.print_exc()

    print()
    print(f"Decode speed: {path} ({lm.mtp_status}), fp32, {BACKEND.note}")
    print(f"{len(prompts)} prompts x {args.prompt_tokens} tokens, {args.max_tokens} new tokens, greedy, round-robin; "
          f"load average {load0[0]:.2f} -> {load1[0]:.2f}")
    print_decode_table(summaries, errors)
    print("tok/s: tokens after the first / (last token time - first token time), summed over prompts; "
          "TTFT: median; identical: prompts whose greedy ids equal mlx-lm's (first divergence: prompt@index, mlx-lm top-2 gap)")
    ours_mtp = [s for s in summaries if s["kind"] == "ours" and s["depth"] > 0]
    mtplx_mtp = [s for s in summaries if s["kind"] == "mtplx" and s["depth"] > 0]
    verdict = {}
    if ours_mtp:
        b = max(ours_mtp, key=lambda s: s["decode_tok_s"])
        verdict["ours_best"] = {"mode": b["mode"], "speedup_vs_mlx_lm": b["speedup_vs_mlx_lm"], "decode_tok_s": b["decode_tok_s"]}
        print(f"best MTP depth (ours): {b['mode']} {b['decode_tok_s']:.1f} tok/s = {b['speedup_vs_mlx_lm']:.2f}x mlx-lm plain "
              f"(target 2.0x: {'met' if b['speedup_vs_mlx_lm'] >= 2.0 else 'missed'})")
        one = next((s for s in summaries if s["mode"] == "mlx-lm plain 1thr"), None)
        if one:
            verdict["ours_best"]["speedup_vs_mlx_lm_1thr"] = round(b["decode_tok_s"] / one["decode_tok_s"], 4)
            print(f"  = {b['decode_tok_s'] / one['decode_tok_s']:.2f}x mlx-lm plain with OpenBLAS on one thread")
    if mtplx_mtp:
        m = max(mtplx_mtp, key=lambda s: s["decode_tok_s"])
        verdict["mtplx_best"] = {"mode": m["mode"], "speedup_vs_mlx_lm": m["speedup_vs_mlx_lm"], "decode_tok_s": m["decode_tok_s"]}
        print(f"best MTP depth (MTPLX): {m['mode']} {m['decode_tok_s']:.1f} tok/s = {m['speedup_vs_mlx_lm']:.2f}x mlx-lm plain")
        if ours_mtp:
            print(f"ours / MTPLX at best depths: {verdict['ours_best']['decode_tok_s'] / m['decode_tok_s']:.2f}x")
    if profile and "error" not in profile:
        c = profile.get("cost_ratios")
        ours_plain = next((s for s in summaries if s["mode"] == "ours plain"), None)
        if c and "draft" in c and ours_plain:
            pred = {}
            for s in ours_mtp:
                K = s["depth"]
                if K + 1 in c["verify"] and s.get("tokens_per_pass"):
                    pred[s["mode"]] = {
                        "predicted_vs_plain": round(s["tokens_per_pass"] / (c["verify"][K + 1] + K * c["draft"]), 4),
                        "measured_vs_plain": round(s["decode_tok_s"] / ours_plain["decode_tok_s"], 4),
                    }
            profile["prediction"] = pred
        print_profile(profile)
    elif profile.get("error"):
        print(f"profile failed: {profile['error']}")

    return {
        "mode": "decode", "model": str(path), "mtp_status": lm.mtp_status,
        "prompt_source": prompt_source, "prompts": [{"label": l, "tokens": len(p)} for l, p in prompts],
        "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "depths": args.depths,
        "loadavg_start": load0, "loadavg_end": load1,
        "summaries": summaries, "errors": errors, "mtplx": mtplx_info, "verdict": verdict, "profile": profile,
        "per_run": {name: [dict(ttft_s=r.ttft_s, decode_s=r.decode_s, n=len(r.tokens), **r.extra) for r in rs]
                    for name, rs in runs.items()},
        "reference_tokens": ref,
    }


def print_profile(profile: dict) -> None:
    print()
    print("Where the time goes (one instrumented run on prompt 1, each piece mx.eval'd; ms per round / backbone pass):")
    hdr = f"{'path':10s} {'round':>8s} {'draft':>8s} {'verify':>8s} {'fwd T=1':>8s} {'commit':>8s} {'other':>8s} {'tok/round':>9s} {'tok/s':>7s}"
    print(hdr)
    for key, p in profile.items():
        if not isinstance(p, dict) or "per_round_ms" not in p:
            continue
        r = p["per_round_ms"]
        print(f"{key:10s} {p['round_ms']:8.2f} {r.get('draft', 0):8.2f} {r.get('verify', 0):8.2f} {r.get('plain_forward', 0):8.2f} "
              f"{r.get('commit', 0):8.2f} {r.get('other', 0):8.2f} {p['tokens_per_round']:9.2f} {p['instrumented_tok_s']:7.1f}")
    print("(draft: MTP head passes incl. LM head; verify: backbone over [x, d1..dK] with GDN capture; fwd T=1: plain step; "
          "commit: GDN select + KV trim; other: sampling/argmax, acceptance, host syncs, Python)")
    c = profile.get("cost_ratios")
    if c:
        v = c["verify"]
        print(f"this model's costs relative to one plain step ({c['step_ms']:.2f} ms): verify "
              + ", ".join(f"T={T} {v[T]:.2f}x" for T in sorted(v)) + (f"; draft {c['draft']:.3f}x" if "draft" in c else ""))
    for mode, p in profile.get("prediction", {}).items():
        print(f"  {mode}: tokens/pass / (verify(K+1) + K*draft) predicts {p['predicted_vs_plain']:.2f}x ours plain; "
              f"measured {p['measured_vs_plain']:.2f}x")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint dir or HF repo (default: the embedded demo model)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--depths", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--mtplx-depths", type=int, nargs="+", default=None, help="MTPLX depths (default: --depths)")
    ap.add_argument("--mtplx-timeout", type=float, default=600.0, help="seconds one MTPLX run may take")
    ap.add_argument("--mtplx-config", choices=sorted(MTPLX_CONFIGS), default="server",
                    help="MTPLX MTP settings: its server's (default) or generate_mtpk's library defaults")
    ap.add_argument("--skip-mtplx", action="store_true")
    ap.add_argument("--no-profile", action="store_true", help="skip the instrumented where-the-time-goes runs")
    ap.add_argument("--json", default=str(DEFAULT_JSON), help=f"write results here (default {DEFAULT_JSON})")
    ap.add_argument("--cost-model", action="store_true", help="cost-model mode on random weights with real layer shapes")
    ap.add_argument("--cost-vocab", type=int, default=32768, help="vocabulary of the random cost-model weights")
    ap.add_argument("--cost-9b-layers", type=int, default=4)
    ap.add_argument("--cost-context", type=int, default=128)
    ap.add_argument("--cost-reps", type=int, default=5)
    args = ap.parse_args(argv)

    args.model_label = "demo model" if args.model is None else Path(args.model).name
    if args.model is None:
        try:
            from mtp_serve.models.demo_model import default_model_path

            args.model_path = Path(default_model_path())
        except FileNotFoundError as e:
            if not args.cost_model:
                sys.exit(str(e))
            args.model_path = None
    else:
        args.model_path = Path(args.model) if Path(args.model).exists() else args.model

    env = {"backend": BACKEND.note, "python": sys.version.split()[0], "platform": platform.platform(),
           "cpus": os.cpu_count(), "argv": sys.argv[1:] if argv is None else argv}
    try:
        import importlib.metadata as md

        env["versions"] = {p: md.version(p) for p in ("mlx", "mlx-lm") }
        try:
            env["versions"]["mtplx"] = md.version("mtplx")
        except md.PackageNotFoundError:
            pass
    except Exception:
        pass
    print(f"backend: {BACKEND.note}", flush=True)

    t0 = pc()
    if args.cost_model:
        res = run_cost_model(args)
        print_cost_tables(res, args.depths)
        res["mode"] = "cost-model"
    else:
        res = run_decode(args)
    res["env"] = env
    res["seconds"] = round(pc() - t0, 1)
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=1, default=_json_default))
        print(f"\nwrote {out} ({res['seconds']:.0f}s)")
    return res


def _json_default(o):
    if isinstance(o, float) and (math.isnan(o) or math.isinf(o)):
        return None
    return str(o)


if __name__ == "__main__":
    main()
