"""Decode speed: mlx-lm plain vs this project's plain and MTP paths vs MTPLX.

    python bench/bench_speed.py [--model DIR] [--max-tokens 128] [--prompts 8] [--depths 1 2 3 4]
                                [--json PATH] [--skip-mtplx]

(The cost model is `bench/cost_model.py`; the MTPLX runner `bench/peers.py`.)

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
* `mtplx ...`: MTPLX on the same checkpoint (`bench/peers.py`), plain
  (`generate_ar`) and MTP (`generate_mtpk`) at each depth with the settings
  its own server passes (`--mtplx-config server`: capture_commit verify,
  conv-tape GDN verify core, committed head history; `library` keeps
  generate_mtpk's slower keyword defaults). When it cannot run, its row
  carries the error.

Per mode: decode tokens/s (tokens after the first / time from the first to the
last token, so prefill is excluded), time to first token, acceptance per draft
position, tokens per backbone pass, and whether the greedy token ids equal
mlx-lm's (for a divergence: the index and mlx-lm's top-two logit gap there; a
gap under 1e-4 is a near-tie, anything else is a bug). Then the round's steps
are timed alone (`bench/bench_round.py`: draft / verify / accept / commit,
each `mx.eval`'d, so the sum is a little above a real round) for plain and the
best depth, and the measured verify/draft cost ratios of the benchmarked model
itself (`bench/cost_model.py`).
"""

from __future__ import annotations

import mtp_serve  # noqa: F401  (before mlx.core: OpenBLAS preload, fp32 on CPU)

import argparse
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Dict, List, Optional

import mlx.core as mx

from bench_round import time_rounds
from common import REPO, RunResult, environment, fp32, load_prompts, median, n_params, one_line, pc, progress, write_json
from cost_model import cost_ratios, measure_costs
from mtp_serve import BACKEND
from mtp_serve.backend import set_blas_threads
from mtp_serve.engine.generator import generate
from mtp_serve.engine.sampling import SamplingParams
from peers import MTPLX_CONFIGS, MtplxWorker

DEFAULT_JSON = REPO / "bench" / "results" / "bench_speed.json"
NEAR_TIE = 1e-4


# --------------------------------------------------------------------------- modes


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


class MtplxMode(Mode):
    kind = "mtplx"

    def __init__(self, worker: Optional[MtplxWorker], depth: int, error: Optional[str] = None):
        self.worker, self.depth, self.error = worker, depth, error
        self.name = "mtplx plain" if depth == 0 else f"mtplx mtp d{depth}"

    def run(self, prompt, n):
        return self.worker.run(prompt, n, self.depth)


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
        "ttft_ms_median": 1e3 * median([r.ttft_s for r in runs]),
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
    from mtp_serve.engine.warmup import calibrate_blas_threads, decode_matmuls_note

    threads = calibrate_blas_threads(lm.model, lm.tokenizer, max(args.depths))  # as mtp-serve does at start-up
    print(f"{decode_matmuls_note(threads)} (measured at load, as mtp-serve does)")
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
        for m in progress(order, f"prompt {i + 1}/{len(prompts)}: modes"):
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

    # where the time goes: the round's steps timed alone, and the model's own cost ratios
    profile: Dict[str, Any] = {}
    if not args.no_profile:
        try:
            profile["plain"] = time_rounds(lm, 1, 0, args.max_tokens // 2)
            best = max((s for s in summaries if s["kind"] == "ours" and s["depth"] > 0),
                       key=lambda s: s["decode_tok_s"], default=None)
            if best:
                profile[f"mtp_d{best['depth']}"] = time_rounds(lm, 1, best["depth"], args.max_tokens // 4)
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
    print("Where the time goes (bench/bench_round.py: the round's steps timed alone, each mx.eval'd; median ms per round):")
    hdr = f"{'path':10s} {'round':>8s} {'draft':>8s} {'verify':>8s} {'accept':>8s} {'commit':>8s}"
    print(hdr)
    for key, p in profile.items():
        if isinstance(p, dict) and "round" in p:
            print(f"{key:10s} {p['round']:8.2f} {p['draft']:8.2f} {p['verify']:8.2f} {p['accept']:8.2f} {p['commit']:8.2f}")
    print("(draft: MTP head passes incl. LM head and draft sampling; verify: backbone over [x, d1..dK] with GDN capture "
          "and the target pipeline; accept: host sync and acceptance; commit: GDN select, KV trim, owed head pairs)")
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
    args = ap.parse_args(argv)

    if args.model is None:
        from mtp_serve.models.demo_model import default_model_path

        args.model_path = Path(default_model_path())
    else:
        args.model_path = Path(args.model) if Path(args.model).exists() else args.model
    print(f"backend: {BACKEND.note}", flush=True)
    t0 = pc()
    res = run_decode(args)
    res["env"] = environment(sys.argv[1:] if argv is None else argv)
    res["seconds"] = round(pc() - t0, 1)
    if args.json:
        write_json(args.json, res)
    return res


if __name__ == "__main__":
    main()
