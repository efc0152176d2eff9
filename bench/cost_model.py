"""Cost model: what a verify window and a draft step cost relative to one plain step,
on random weights with real layer shapes, and the speedup that predicts.

    python bench/cost_model.py [--model DIR] [--vocab 32768] [--9b-layers 4] [--context 128] [--reps 5]
                               [--depths 1 2 3 4] [--json PATH]

Random weights, fp32, with Qwen3.5-0.8B's layer shapes (all 24 layers;
vocabulary reduced to `--vocab` to save memory) and a Qwen3.5-9B-like shape
(hidden 4096, `--9b-layers` of its 32 layers built), plus the `--model`
checkpoint (default: the demo model): cost of a T-token verify forward (GDN
state capture on) plus its commit relative to a plain one-token step for
T = 1..5, and of one MTP draft step. Because the LM head and the layer count
are cut, each shape also gets a projected full-model row: layers scaled to the
real layer count and the LM head re-timed at the real vocabulary (248,320) as a
plain matmul. The predicted speedup for acceptance a at depth K is E/cost,
E = sum_{j=0..K} a^j, cost = verify(K+1) + K * draft (both relative to one
plain step).
"""

from __future__ import annotations

import mtp_serve  # noqa: F401  (before mlx.core: OpenBLAS preload, fp32 on CPU)

import argparse
import gc
from pathlib import Path
from typing import Dict, List, Optional

import mlx.core as mx

from common import REPO, environment, fp32, median, n_params, one_line, pc, write_json
from mtp_serve import BACKEND
from mtp_serve.models.caches import keep_verified, set_capture

DEFAULT_JSON = REPO / "bench" / "results" / "cost_model.json"
ACCEPTANCES = (0.5, 0.7, 0.8, 0.9)
QWEN35_VOCAB = 248320


def measure_costs(model, *, context: int = 128, reps: int = 5, Ts=(1, 2, 3, 4, 5), seed: int = 0,
                  full_vocab: Optional[int] = None, log=print) -> dict:
    """Median seconds of: a plain T=1 step, a T-token verify (capture on) and its commit, one draft step,
    and the model's LM head alone over T rows (and at `full_vocab` as a plain matmul)."""
    V = model.vocab_size
    H = model.text.args.hidden_size  # (not the embedding's width: packed when quantized)
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
        keep_verified(cache, [1], T)  # the commit's state is part of the cost
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
    med = {k: median(v) for k, v in res.items()}
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


def flash_next_text(vocab: int) -> dict:
    """Qwen3.8-Flash-Next's shapes (hidden 2048, 4 streams, 512 experts top 10 with a shared
    expert, GatedDeltaNet 16k/32v heads x128, attention 16q/2kv x256 with the QSA indexer)
    scaled to fit the 2-core machine's 24 GiB in fp32: 8 of its 40 layers (6 GatedDeltaNet,
    2 indexed attention), 64 of the 512 experts, PLE on 2 layers with n-gram tables of
    16 x ~50k rows (the real ones are 16 x ~20M), hc_lowrank 320."""
    from mtp_serve.testing.synthetic import tiny_qwen4_exp_text_config

    return tiny_qwen4_exp_text_config(
        hidden_size=2048, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        linear_num_value_heads=32, linear_num_key_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2, vocab_size=vocab,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [11, 11, 10]},
        num_experts=64, num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        hc_count=4, hc_lowrank=320, ple_layer_ids=[1, 5], ple_embed_dim=2048, heads_per_ngram=8,
        ngram_vocab_size_base=50_000, split_ngram_parts=4, indexer_n_heads=16, indexer_head_dim=128,
        indexer_budget=2048, indexer_compress_ratio=4, eos_token_id=248044)


def random_qwen4_exp_model(text: dict):
    """A random qwen4_exp MTPModel (fp32) with these text-config values."""
    from mtp_serve.models.gdn import install_capturing_gdn
    from mtp_serve.models.model_card import load_card
    from mtp_serve.models.qwen4_exp_mtp import Qwen4ExpMTPModel
    from mtp_serve.testing.synthetic import build_random

    model, head, _ = build_random("qwen4_exp", text)
    fp32(model)
    fp32(head)
    mx.eval(model.parameters(), head.parameters())
    install_capturing_gdn(model.layers)
    model.eval()
    head.eval()
    return Qwen4ExpMTPModel(model, model.language_model, head, load_card("qwen4_exp"), "qwen4_exp")


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


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a checkpoint to measure too (default: the embedded demo model)")
    ap.add_argument("--vocab", dest="cost_vocab", type=int, default=32768, help="vocabulary of the random weights")
    ap.add_argument("--9b-layers", dest="cost_9b_layers", type=int, default=4)
    ap.add_argument("--context", dest="cost_context", type=int, default=128)
    ap.add_argument("--reps", dest="cost_reps", type=int, default=5)
    ap.add_argument("--depths", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--json", default=str(DEFAULT_JSON))
    args = ap.parse_args(argv)
    if args.model is None:
        from mtp_serve.models.demo_model import DEMO_MODEL_DIR

        args.model_path = DEMO_MODEL_DIR if (DEMO_MODEL_DIR / "config.json").exists() else None
        args.model_label = "demo model"
    else:
        args.model_path, args.model_label = args.model, Path(args.model).name
    print(f"backend: {BACKEND.note}", flush=True)
    t0 = pc()
    res = run_cost_model(args)
    print_cost_tables(res, args.depths)
    res.update(mode="cost-model", env=environment(argv), seconds=round(pc() - t0, 1))
    if args.json:
        write_json(args.json, res)
    return res


if __name__ == "__main__":
    main()
