"""Images in the prompt: what the vision tower costs, what prefill, the prompt cache and MTP
decode do with an image, side by side with text of the same length.

    python bench/bench_vision.py                                   # both rows, 4-5 minutes on 2 busy cores
    python bench/bench_vision.py --rows demo --sizes 256x256 512x512 1024x768
    python bench/bench_vision.py --rows 0.8b --sizes-08b 256x256 512x512 1024x768 --json out.json

Rows (both are timing models, not quality models: the towers have random weights):
- `demo`: the shipped demo model (text only, hidden 192) with a random tower attached of
  Qwen3.5's layout (models/vision's VisionTower: patch embed, learned positions, 2-D
  rotary blocks, merger) at the demo's scale: depth 12, hidden 192, 3 heads of 64,
  intermediate 768, patch 16, temporal 2, merge 2, out_hidden 192 (`--demo-tower 0.8b`:
  Qwen3.5-0.8B's tower instead, projecting to 192). The demo tokenizer has no vision
  tokens: the bench uses ids 4084 (vision_start), 4085 (vision_end) and 4086 (image_pad),
  ordinary BPE tokens of its vocabulary (they only delimit the image here), and keeps
  them out of the text parts of the prompts. The demo decodes its own held-out code, so
  its MTP acceptance is the head's own.
- `0.8b`: a random Qwen3.5-0.8B-shaped model (bench/cost_model.py's text shapes, fp32,
  the real 248,320-token vocabulary) with Qwen3.5-0.8B's vision tower: depth 12, hidden
  768, 12 heads, intermediate 3072, patch 16, temporal 2, merge 2, 2304 position
  embeddings, out_hidden 1024, and its token ids (vision_start 248053, vision_end
  248054, image_pad 248056), as the released config.json has them (the mlx-vlm 0.7.10
  VisionConfig defaults are Qwen3-VL's, depth 32 / hidden 1280, not these). Random
  weights accept no drafts, so its MTP runs use bench_acceptance_speed's benchmark-only
  oracle at acceptance --acceptance (0.8): the real head runs, its tokens are replaced.
Both use Qwen3.5's processor bounds (min 65,536, max 16,777,216 pixels, factor 32); the
sizes given are already multiples of 32, so the processor's resize keeps them.

Per row:
1. encode: the tower alone (`Vision.encode`, evaluated) per image size, its patches and
   tokens, seconds and milliseconds per image token; also `prepare_image` (PNG decode,
   resize, normalise, patchify).
2. prefill: time to first token of a prompt with one --prompt-size image (text before and
   after it) against a text-only prompt of the same length, with the encode's share;
   both cold, both storing a prompt-cache snapshot at the prompt's end as the server does.
3. second turn: turn 1 + the model's reply + a follow-up question; time to first token
   with the prompt cache in memory holding turn 1 and its reply (`PromptCache`) against
   cold, with the image encodes each did (counted on the tower) and the tokens restored.
4. decode: tokens/s after the first token, plain and MTP at --depths, from the prompt's
   cached state, with the image prompt and with the text-only one (their runs interleaved;
   the fastest of --repeats counts); acceptance; each MTP run's tokens must equal plain's
   (greedy) or the bench stops with an error.
"""

from __future__ import annotations

import argparse
import gc
import io
import os
import sys
from contextlib import nullcontext
from pathlib import Path

from common import environment, pc, progress, write_json  # noqa: I001  (first: backend set-up before mlx.core)

import mlx.core as mx
import numpy as np

from mtp_serve import BACKEND
from mtp_serve.engine.generator import generate
from mtp_serve.engine.prompt_cache import PromptCache
from mtp_serve.engine.sampling import SamplingParams
from mtp_serve.models.vision import Vision, VisionSpec, prepare_image
from mtp_serve.models.vision.tower import TowerConfig, VisionTower

QWEN35_08B_TOWER = dict(depth=12, hidden_size=768, intermediate_size=3072, num_heads=12, out_hidden_size=1024,
                        patch_size=16, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=2304)
DEMO_TOWER = dict(QWEN35_08B_TOWER, hidden_size=192, intermediate_size=768, num_heads=3, out_hidden_size=192)
DEMO_IDS = dict(vision_start_token_id=4084, vision_end_token_id=4085, image_token_id=4086)
QWEN35_IDS = dict(vision_start_token_id=248053, vision_end_token_id=248054, image_token_id=248056)
BEFORE, AFTER, FOLLOW_UP = 24, 40, 32  # text tokens before the image, after it, and the next turn's question


class TimedVision:
    """The model's Vision, counting the images it encodes and the seconds the tower takes
    (whole with `encode`, or block by block with `encode_steps` as the engine runs it)."""

    def __init__(self, vision: Vision):
        self.inner, self.spec = vision, vision.spec
        self.encoded, self.seconds = 0, 0.0

    def encode(self, images):
        t0 = pc()
        out = self.inner.encode(images)
        mx.eval(out)
        self.seconds += pc() - t0
        self.encoded += len(images)
        return out

    def encode_steps(self, image, *args, **kwargs):
        pieces = self.inner.encode_steps(image, *args, **kwargs)
        while True:
            t0 = pc()
            piece = next(pieces, StopIteration)
            if piece is not None and piece is not StopIteration:
                mx.eval(piece)
                self.encoded += 1
            self.seconds += pc() - t0
            if piece is StopIteration:
                return
            yield piece

    def __getattr__(self, name):  # anything else the engine asks of a Vision
        return getattr(self.inner, name)

    def reset(self) -> None:
        self.encoded, self.seconds = 0, 0.0


def attach_vision(model, tower_shape: dict, ids: dict, seed: int = 0) -> TimedVision:
    """A random tower of `tower_shape` (fp32) and a VisionSpec with the text model's M-RoPE sections."""
    rope = model.text.args.rope_parameters
    config = dict(ids, vision_config=tower_shape, text_config={"rope_parameters": rope})
    mx.random.seed(seed)
    tower = VisionTower(TowerConfig.from_dict(tower_shape))
    tower.set_dtype(mx.float32)
    mx.eval(tower.parameters())
    tower.eval()
    model.vision = TimedVision(Vision(VisionSpec.from_config(config), tower, out_dtype=mx.float32))
    return model.vision


def demo_row(args):
    from mtp_serve.models.demo_model import default_model_path
    from mtp_serve.models.loader import load_model

    from common import load_prompts

    lm = load_model(default_model_path())
    shape = dict(QWEN35_08B_TOWER, out_hidden_size=lm.model.text.args.hidden_size) if args.demo_tower == "0.8b" \
        else DEMO_TOWER
    vision = attach_vision(lm.model, shape, DEMO_IDS)
    prompts, _ = load_prompts(Path(default_model_path()), lm.tokenizer, 8, 1024)
    vision_ids = set(DEMO_IDS.values())
    text = [t for _, ids in prompts for t in ids if t not in vision_ids]
    return lm, vision, shape, text, None, args.sizes, args.tokens


def row_08b(args):
    from bench_acceptance_speed import Tok
    from cost_model import QWEN35_VOCAB, qwen35_08b_text, random_mtp_model

    model = random_mtp_model(qwen35_08b_text(QWEN35_VOCAB))
    lm = type("LM", (), {"model": model, "tokenizer": Tok()})()
    vision = attach_vision(model, QWEN35_08B_TOWER, QWEN35_IDS)
    # Random text below the vision ids (248,053 and up).
    text = mx.random.randint(0, 248000, (8192,), key=mx.random.key(1)).tolist()
    return lm, vision, QWEN35_08B_TOWER, text, QWEN35_VOCAB, args.sizes_08b, args.tokens_08b


ROWS = {"demo": demo_row, "0.8b": row_08b}


def png(width: int, height: int, seed: int = 0) -> bytes:
    arr = np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    from PIL import Image

    Image.fromarray(arr).save(buf, "PNG")
    return buf.getvalue()


def size(s: str) -> tuple:
    w, h = s.lower().split("x")
    return int(w), int(h)


def run(lm, prompt, n, depth, cache=None, images=(), checkpoints=()):
    """Greedy tokens, time to first token, decode tokens/s after it, and the last stats."""
    toks, first, last, stats = [], None, None, None
    t0 = pc()
    for chunk in generate(lm.model, lm.tokenizer, prompt, SamplingParams(max_tokens=n, ignore_eos=True), depth, cache,
                          checkpoints=checkpoints, images=images):
        last = pc()
        first = first or last
        toks += chunk.token_ids
        stats = chunk.stats
    tok_s = (len(toks) - 1) / (last - first) if len(toks) > 1 and last > first else float("nan")
    return toks, first - t0, tok_s, stats


def image_prompt(spec: VisionSpec, text: list, n_image: int, offset: int = 0) -> list:
    """Text, the image's tokens, more text: BEFORE + n_image + 2 + AFTER tokens."""
    t = text[offset:]
    return (t[:BEFORE] + [spec.vision_start_token_id] + [spec.image_token_id] * n_image + [spec.vision_end_token_id]
            + t[BEFORE : BEFORE + AFTER])


def encode_times(name, vision, spec, sizes, repeats) -> list:
    out = []
    warm = prepare_image(png(256, 256, seed=99), spec)
    vision.inner.encode([warm])  # first-call allocations
    for w, h in progress(sizes, f"[{name}] encode"):
        data = png(w, h, seed=w * h)
        t0 = pc()
        im = prepare_image(data, spec)
        prep = pc() - t0
        times = []
        for _ in range(repeats):
            t0 = pc()
            mx.eval(vision.inner.encode([im]))
            times.append(pc() - t0)
        _, gh, gw = im.grid_thw
        r = dict(model=name, size=f"{w}x{h}", resized=f"{gw * spec.patch_size}x{gh * spec.patch_size}",
                 patches=gh * gw, tokens=im.n_tokens, prepare_s=prep, encode_s=min(times))
        out.append(r)
        print(f"[{name}] {r['size']} (resized {r['resized']}): {r['patches']} patches -> {r['tokens']} tokens, "
              f"prepare {prep * 1000:.0f} ms, encode {r['encode_s']:.2f}s "
              f"({1000 * r['encode_s'] / r['tokens']:.1f} ms/token)", flush=True)
    return out


def best(runs: dict, key: str) -> dict:
    """The fastest run's figures (by `key`) out of lists of per-run values: a busy machine only adds time."""
    i = min(range(len(runs[key])), key=runs[key].__getitem__)
    return {k: v[i] for k, v in runs.items()}


def check_same(got, want, what: str) -> None:
    if got != want:
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        raise RuntimeError(f"{what}: greedy MTP output differs from greedy plain at token {first}")


def decode_speeds(name, lm, steps: dict, caches: dict, tokens, args, oracle_vocab) -> dict:
    """Plain and MTP decode from each prompt's cached state. The prompts (image, text) and the
    modes interleave run by run, so the machine's load drifts onto both alike; MTP must equal plain."""
    from bench_acceptance_speed import oracle_drafts

    def go(kind, n, depth):
        prompt, images = steps[kind]
        # 0.8b: drafts from the oracle, the same draws for every run (fresh seed each run).
        context = oracle_drafts(plain[kind], args.acceptance, oracle_vocab) if depth and oracle_vocab else nullcontext()
        with context:
            return run(lm, prompt, n, depth, caches[kind], images, (len(prompt) - 1,))

    plain = {}
    for kind in steps:
        go(kind, 4, 0)  # warm-up (decode shapes)
        plain[kind] = go(kind, tokens, 0)[0]
        go(kind, 8, max(args.depths))  # warm-up (verify windows)
    speeds = {k: {d: [] for d in (0, *args.depths)} for k in steps}
    acc = {k: {d: [] for d in args.depths} for k in steps}
    runs = [(d, k) for r in range(args.repeats) for d in ((0, *args.depths) if r % 2 == 0 else (*args.depths, 0))
            for k in (list(steps) if r % 2 == 0 else list(steps)[::-1])]
    for depth, kind in progress(runs, f"[{name}] decode"):
        toks, _, tok_s, stats = go(kind, tokens, depth)
        check_same(toks, plain[kind], f"{name}, {kind} prompt, {f'depth {depth}' if depth else 'plain'}")
        speeds[kind][depth].append(tok_s)
        if depth:
            acc[kind][depth].append(stats.acceptance_rate)
    out = {}
    for kind in steps:
        best = {d: max(v) for d, v in speeds[kind].items()}
        out[kind] = dict(plain_tok_s=best[0], reply=plain[kind],
                         mtp={d: dict(tok_s=best[d], speedup=best[d] / best[0],
                                      acceptance=sum(acc[kind][d]) / len(acc[kind][d])) for d in args.depths})
    return out


def run_row(name: str, args) -> dict:
    t0, load0 = pc(), os.getloadavg()[0]
    lm, vision, shape, text, oracle_vocab, sizes, tokens = ROWS[name](args)
    spec = vision.spec
    print(f"[{name}] loaded in {pc() - t0:.0f}s; tower depth {shape['depth']}, hidden {shape['hidden_size']}, "
          f"heads {shape['num_heads']}, out {shape['out_hidden_size']}", flush=True)
    out = dict(model=name, tower=shape, ids={k: getattr(spec, k) for k in QWEN35_IDS},
               encode=encode_times(name, vision, spec, [size(s) for s in sizes], args.encode_repeats))

    # 2. prefill with the image against text of the same length, cold, alternating; each run
    # stores its end snapshot, as the server does (the last run's cache feeds the decode runs).
    w, h = size(args.prompt_size)
    image = prepare_image(png(w, h, seed=7), spec)
    prompt_img = image_prompt(spec, text, image.n_tokens)
    # The same text around it, the image's place filled with other text: both continue the same question.
    prompt_txt = text[:BEFORE] + text[3000 : 3002 + image.n_tokens] + text[BEFORE : BEFORE + AFTER]
    assert len(prompt_txt) == len(prompt_img)
    steps = {"image": (prompt_img, (image,)), "text": (prompt_txt, ())}
    caches, prefill = {}, {k: dict(ttft_s=[], encode_s=[], encodes=[]) for k in steps}
    order = [k for r in range(args.repeats) for k in (("image", "text") if r % 2 == 0 else ("text", "image"))]
    for kind in progress(order, f"[{name}] prefill"):
        prompt, images = steps[kind]
        caches[kind] = PromptCache(max_bytes=16 << 30, interval=0)
        vision.reset()
        _, ttft, _, _ = run(lm, prompt, 1, 0, caches[kind], images, (len(prompt) - 1,))
        for key, v in (("ttft_s", ttft), ("encode_s", vision.seconds), ("encodes", vision.encoded)):
            prefill[kind][key].append(v)
        print(f"[{name}] prefill {kind}: {len(prompt)} tokens, first token {ttft:.2f}s "
              f"(encode {vision.seconds:.2f}s, {vision.encoded} image)", flush=True)
    out["prefill"] = dict(size=args.prompt_size, tokens=len(prompt_img), image_tokens=image.n_tokens,
                          **{k: best(v, "ttft_s") for k, v in prefill.items()})

    # 4. decode with and without the image, from the snapshots just stored.
    decode = decode_speeds(name, lm, steps, caches, tokens, args, oracle_vocab)
    for kind, d in decode.items():
        print(f"[{name}] decode {kind}: plain {d['plain_tok_s']:.1f} tok/s, " + ", ".join(
            f"MTP d{k} {m['tok_s']:.1f} ({m['speedup']:.2f}x, acceptance {m['acceptance']:.2f})"
            for k, m in d["mtp"].items()) + "; MTP = plain", flush=True)

    # 3. the next turn: turn 1 + reply + a question, cold and with the image prompt's cache (it holds
    # turn 1 and the decode runs' reply); each repeat asks another question, so each restores the same.
    reply = decode["image"].pop("reply")
    decode["text"].pop("reply")
    turn = {k: dict(ttft_s=[], encodes=[], encode_s=[], cached_tokens=[]) for k in ("cold", "warm")}
    order = [k for r in range(args.repeats) for k in (("cold", "warm") if r % 2 == 0 else ("warm", "cold"))]
    for i, kind in enumerate(progress(order, f"[{name}] turn 2")):
        turn2 = prompt_img + reply + text[2000 + 100 * i : 2000 + 100 * i + FOLLOW_UP]
        vision.reset()
        _, ttft, _, stats = run(lm, turn2, 1, max(args.depths), caches["image"] if kind == "warm" else None, (image,))
        for key, v in (("ttft_s", ttft), ("encodes", vision.encoded), ("encode_s", vision.seconds),
                       ("cached_tokens", stats.cached_tokens)):
            turn[kind][key].append(v)
        print(f"[{name}] turn 2 {kind}: {len(turn2)} tokens, first token {ttft:.2f}s, {vision.encoded} image "
              f"encode(s), {stats.cached_tokens} tokens from the prompt cache", flush=True)
    if any(turn["warm"]["encodes"]):
        raise RuntimeError(f"{name}: the second turn encoded the image again although the prompt cache held it")
    turn = {k: best(v, "ttft_s") for k, v in turn.items()}
    out["turn2"] = dict(tokens=len(turn2), **turn)
    out["decode"] = dict(tokens=tokens, prompt_tokens=len(prompt_img), **decode)
    out["seconds"] = pc() - t0
    out["load"] = dict(start=load0, end=os.getloadavg()[0])  # this machine is shared: the figures' noise
    del lm, vision, caches
    gc.collect()
    mx.clear_cache()
    return out


def tables(rows: list, args) -> None:
    for r in rows:
        print(f"\n[{r['model']}] {r['seconds']:.0f}s; load average (1 min) {r['load']['start']:.1f} at the start, "
              f"{r['load']['end']:.1f} at the end ({os.cpu_count()} CPUs)")
    print("\n| model | image | patches -> tokens | prepare ms | encode s | ms / image token |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        for e in r["encode"]:
            print(f"| {r['model']} | {e['size']} | {e['patches']} -> {e['tokens']} | {1000 * e['prepare_s']:.0f} | "
                  f"{e['encode_s']:.2f} | {1000 * e['encode_s'] / e['tokens']:.1f} |")
    print("\n| model | prompt | first token, image | of it: encode | the rest | first token, text only | "
          "image / text | the rest / text |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        p = r["prefill"]
        img, txt = p["image"], p["text"]["ttft_s"]
        rest = img["ttft_s"] - img["encode_s"]
        print(f"| {r['model']} | {p['tokens']} tokens ({p['image_tokens']} of a {p['size']} image) | "
              f"{img['ttft_s']:.2f}s | {img['encode_s']:.2f}s | {rest:.2f}s | {txt:.2f}s | "
              f"{img['ttft_s'] / txt:.2f}x | {rest / txt:.2f}x |")
    print("\n| model | turn 2 | cold: first token (encodes) | cached: first token (encodes, tokens restored) | cold / cached |")
    print("|---|---|---|---|---|")
    for r in rows:
        t = r["turn2"]
        print(f"| {r['model']} | {t['tokens']} tokens | {t['cold']['ttft_s']:.2f}s ({t['cold']['encodes']}) | "
              f"{t['warm']['ttft_s']:.3f}s ({t['warm']['encodes']}, {t['warm']['cached_tokens']}) | "
              f"{t['cold']['ttft_s'] / t['warm']['ttft_s']:.1f}x |")
    depths = args.depths
    print("\n| model | prompt | plain tok/s | " + " | ".join(f"MTP d{d} tok/s (x plain, acceptance)" for d in depths)
          + " | image / text, plain | " + " | ".join(f"image / text, d{d}" for d in depths) + " |")
    print("|---|---|---|" + "---|" * len(depths) + "---|" + "---|" * len(depths))
    for r in rows:
        dec = r["decode"]
        for kind in ("image", "text"):
            d = dec[kind]
            cells = " | ".join(f"{d['mtp'][k]['tok_s']:.1f} ({d['mtp'][k]['speedup']:.2f}x, {d['mtp'][k]['acceptance']:.2f})"
                               for k in depths)
            if kind == "image":
                t = dec["text"]
                ratios = f"{d['plain_tok_s'] / t['plain_tok_s']:.2f} | " + " | ".join(
                    f"{d['mtp'][k]['tok_s'] / t['mtp'][k]['tok_s']:.2f}" for k in depths)
            else:
                ratios = " | ".join([""] * (len(depths) + 1))
            print(f"| {r['model']} | {kind}, {dec['prompt_tokens']} tokens, {dec['tokens']} decoded | "
                  f"{d['plain_tok_s']:.1f} | {cells} | {ratios} |")


def tower_attention(sizes: list) -> None:
    """The 0.8B tower alone with MLX's attention and with the blockwise CPU attention it uses
    (alternating, best of 2): the whole encode's time and how far the features move."""
    import mtp_serve.models.vision.tower as tower_module

    spec = VisionSpec.from_config(dict(QWEN35_IDS, vision_config=QWEN35_08B_TOWER, text_config={
        "rope_parameters": {"mrope_section": [11, 11, 10], "rope_theta": 1e7, "partial_rotary_factor": 0.25}}))
    mx.random.seed(0)
    tower = VisionTower(TowerConfig.from_dict(QWEN35_08B_TOWER))
    tower.set_dtype(mx.float32)
    mx.eval(tower.parameters())
    paths = {"mlx": lambda q, k, v, scale: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale),
             "blockwise": tower_module.full_attention}
    print("| image | tokens | MLX attention s | blockwise s | speed-up | max feature difference |\n|---|---|---|---|---|---|")
    try:
        for w, h in (size(s) for s in sizes):
            im = prepare_image(png(w, h), spec)
            times, outs = {}, {}
            for name in ["mlx", "blockwise"] * 2:
                tower_module.full_attention = paths[name]
                t0 = pc()
                outs[name] = tower(mx.array(im.pixels), im.grid_thw)
                mx.eval(outs[name])
                times[name] = min(times.get(name, 1e9), pc() - t0)
            diff = float(mx.abs(outs["mlx"] - outs["blockwise"]).max())
            print(f"| {w}x{h} | {im.n_tokens} | {times['mlx']:.2f} | {times['blockwise']:.2f} | "
                  f"{times['mlx'] / times['blockwise']:.2f}x | {diff:.1e} |", flush=True)
    finally:
        tower_module.full_attention = paths["blockwise"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", nargs="+", default=["demo", "0.8b"], choices=sorted(ROWS))
    p.add_argument("--sizes", nargs="+", default=["256x256", "512x512", "1024x768"], help="demo: encode sizes (WxH)")
    p.add_argument("--sizes-08b", nargs="+", default=["256x256", "512x512"],
                   help="0.8b: encode sizes (1024x768 takes ~1.5 min on 2 busy cores)")
    p.add_argument("--prompt-size", default="256x256", help="the image in the prefill, turn-2 and decode prompts")
    p.add_argument("--demo-tower", choices=["demo", "0.8b"], default="demo")
    p.add_argument("--tokens", type=int, default=64, help="demo: tokens decoded per run")
    p.add_argument("--tokens-08b", type=int, default=16, help="0.8b: tokens decoded per run")
    p.add_argument("--depths", type=int, nargs="+", default=[2, 3])
    p.add_argument("--repeats", type=int, default=2,
                   help="runs of each prefill, turn-2 and decode mode (alternating; the fastest counts)")
    p.add_argument("--encode-repeats", type=int, default=2)
    p.add_argument("--acceptance", type=float, default=0.8, help="0.8b: the oracle's acceptance")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--tower-attention", nargs="+", metavar="WxH",
                   help="only: the 0.8B tower's encode with MLX's attention against the blockwise CPU one")
    args = p.parse_args(argv)
    print(BACKEND.note, flush=True)
    if args.tower_attention:
        tower_attention(args.tower_attention)
        return 0
    rows = [run_row(name, args) for name in args.rows]
    tables(rows, args)
    if args.json:
        write_json(args.json, {"env": environment(sys.argv), "args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
