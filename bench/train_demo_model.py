"""Train the project's demo model: a small Qwen3.5-architecture code model with an MTP head.

Data: the Python standard library sources of the running interpreter (no
download), test directories excluded; a deterministic ~2% of the files (by a
hash of their relative path) is held out for evaluation and for the
acceptance benchmark (`bench/demo_acceptance.py`). A fraction of the training
files is wrapped as a chat turn (Qwen3.5 template, thinking off) so the model
answers through the chat endpoint and stops on `<|im_end|>`.

Stage 1 trains the backbone (next-token cross-entropy, AdamW, warmup plus a
cosine schedule over the stage's wall-clock budget, fp32). Stage 2 freezes
the backbone and trains the MTP head on the backbone's post-final-norm hidden
states: the entry at position p sees (H[p], emb(x[p+1])) and is trained to
match the backbone's own next-next distribution (soft targets from the
backbone's logits at p+1; `--head-true-weight` mixes in the true x[p+2]), which
is what greedy acceptance measures. `--chain-weights` also trains it chained at
depth 2, 3, ...: its own output hidden at p with emb(x[p+2]) predicts the
backbone's distribution at p+2, and so on. `--on-policy-fraction` mixes in the
backbone's own greedy rollouts (the trajectories greedy MTP decoding drafts
along); `--init-from` with `--stages 2` retrains only the head of an exported
checkpoint.

Every stage stops on its wall-clock budget and saves; the run is resumable
(state under `--work-dir`; run the same command again). The result is
written in the official Hugging Face layout (bf16, zero-centred norms,
`mtp.*` in its own shard) with the tokenizer, chat template and
generation_config.json.

    python bench/train_demo_model.py --out models/demo --work-dir .work/demo_train \\
        --stage1-min 47 --stage2-min 15
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import mtp_serve  # noqa: F401  (before mlx.core: preloads OpenBLAS)

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from mtp_serve.models.gdn import install_capturing_gdn
from mtp_serve.testing.hf_layout import hf_weights, save_hf_checkpoint
from mtp_serve.models.mtp_head import MTPHead
from mtp_serve.testing.synthetic import hf_config
from mtp_serve.testing.tokenizer_builder import load_tokenizer_json, save_tokenizer, train_tokenizer

REPO = Path(__file__).resolve().parents[1]
DEFAULT_SRC = Path(os.__file__).parent  # the stdlib of this interpreter
EXCLUDE_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "lib2to3", "turtledemo"}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------- data


def list_sources(src: Path) -> list[Path]:
    files = []
    for p in sorted(src.rglob("*.py")):
        rel = p.relative_to(src)
        if any(part in EXCLUDE_DIRS or part.startswith("test_") for part in rel.parts):
            continue
        files.append(p)
    return files


def is_heldout(rel: str, heldout_per_mille: int) -> bool:
    return int(hashlib.sha1(rel.encode()).hexdigest(), 16) % 1000 < heldout_per_mille


CHAT_PROMPTS = [
    "Show me the source of the Python module `{mod}`.",
    "Write the Python module `{mod}`.",
    "Print the code of `{path}` from the standard library.",
    "Implement `{mod}` in Python.",
]


def chat_wrap(code: str, rel: str, rng: random.Random) -> str:
    mod = rel[:-3].replace("/", ".").replace(".__init__", "")
    user = rng.choice(CHAT_PROMPTS).format(mod=mod, path=rel)
    sys_part = "<|im_start|>system\nYou are a helpful coding assistant.<|im_end|>\n" if rng.random() < 0.5 else ""
    if rng.random() < 0.8:  # the template's default: thinking off
        think = "<think>\n\n</think>\n\n"
    else:
        think = f"<think>\nThe user wants the source of {mod}. I will write it in one code block.\n</think>\n\n"
    return (f"{sys_part}<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n{think}"
            f"```python\n{code.rstrip()}\n```<|im_end|>\n")


def prepare_data(args) -> dict:
    """Tokenizer and token streams, cached in the work dir."""
    wd = Path(args.work_dir)
    meta_path = wd / "data_meta.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        train = np.load(wd / "train_tokens.npy")
        held = np.load(wd / "heldout_tokens.npy")
        log(f"data: cached ({len(train):,} train tokens, {len(held):,} held-out tokens)")
        return dict(meta=meta, train=train, heldout=held, tok=load_tokenizer_json(wd / "tokenizer.json"))
    src = Path(args.data_dir)
    files = list_sources(src)
    train_docs, held_docs, held_files = [], [], []
    for p in files:
        rel = p.relative_to(src).as_posix()
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if len(text) < 200:
            continue
        (held_docs if is_heldout(rel, args.heldout_per_mille) else train_docs).append((rel, text))
    held_files = [r for r, _ in held_docs]
    log(f"data: {len(train_docs)} train files ({sum(len(t) for _, t in train_docs) / 1e6:.1f} MB), "
        f"{len(held_docs)} held-out files")
    t0 = time.time()
    if args.init_from:  # keep the checkpoint's own tokenizer
        tok = load_tokenizer_json(Path(args.init_from) / "tokenizer.json")
        log(f"tokenizer: {tok.get_vocab_size()} ids from {args.init_from}")
    else:
        tok = train_tokenizer((t for _, t in train_docs), vocab_size=args.vocab)
        log(f"tokenizer: {tok.get_vocab_size()} ids trained in {time.time() - t0:.0f}s")
    tok.save(str(wd / "tokenizer.json"))
    eot = tok.token_to_id("<|endoftext|>")
    rng = random.Random(1234)
    texts = []
    for rel, text in train_docs:
        texts.append(chat_wrap(text, rel, rng) if rng.random() < args.chat_fraction else text)

    def stream(docs):
        ids = []
        for enc in tok.encode_batch(docs, add_special_tokens=False):
            ids.extend(enc.ids)
            ids.append(eot)
        return np.array(ids, dtype=np.uint16)

    train = stream(texts)
    held = stream([t for _, t in held_docs])
    np.save(wd / "train_tokens.npy", train)
    np.save(wd / "heldout_tokens.npy", held)
    meta = dict(source=str(src), train_files=len(train_docs), heldout_files=held_files,
                train_tokens=int(len(train)), heldout_tokens=int(len(held)),
                train_bytes=int(sum(len(t.encode()) for _, t in train_docs)),
                chat_fraction=args.chat_fraction, heldout_per_mille=args.heldout_per_mille)
    meta_path.write_text(json.dumps(meta, indent=1))
    log(f"data: {len(train):,} train tokens ({meta['train_bytes'] / len(train):.2f} bytes/token), "
        f"{len(held):,} held-out tokens")
    return dict(meta=meta, train=train, heldout=held, tok=tok)


def batches(stream: np.ndarray, batch: int, seq: int, seed: int):
    rng = np.random.default_rng(seed)
    n = len(stream) - seq - 2
    while True:
        starts = rng.integers(0, n, size=batch)
        yield mx.array(np.stack([stream[s : s + seq + 2] for s in starts]).astype(np.int32))


def mixed_batches(stream: np.ndarray, rollouts: np.ndarray | None, fraction: float, batch: int, seq: int, seed: int):
    """Text windows, with `fraction` of the rows drawn from the backbone's own greedy rollouts."""
    text = batches(stream, batch, seq, seed)
    rng = np.random.default_rng(seed + 1)
    while True:
        x = next(text)
        if rollouts is None or fraction <= 0:
            yield x
            continue
        take = rng.random(batch) < fraction
        if take.any():
            rows = np.array(x)
            rows[take] = rollouts[rng.integers(0, len(rollouts), size=int(take.sum()))][:, : seq + 2]
            x = mx.array(rows)
        yield x


def greedy_rollouts(model, stream: np.ndarray, n: int, prompt_len: int, gen_len: int, batch: int, seed: int) -> np.ndarray:
    """[n, prompt_len + gen_len] windows: a text prompt, then the backbone's own greedy continuation.

    Greedy MTP decoding drafts along the backbone's own output, which for a small
    model is far more repetitive than the training text: training the head on
    these trajectories (on-policy) is what raises greedy acceptance.
    """
    rng = np.random.default_rng(seed)
    lm = model.language_model
    rows = []
    for i in range(0, n, batch):
        starts = rng.integers(0, len(stream) - prompt_len, size=min(batch, n - i))
        x = mx.array(np.stack([stream[s : s + prompt_len] for s in starts]).astype(np.int32))
        cache = lm.make_cache()
        tok = mx.argmax(lm(x, cache=cache)[:, -1:], -1)
        out = [x]
        for _ in range(gen_len):
            out.append(tok)
            tok = mx.argmax(lm(tok, cache=cache)[:, -1:], -1)
            mx.eval(tok)
        rows.append(np.array(mx.concatenate(out, axis=1)).astype(np.int32))
        log(f"rollouts: {i + len(starts)}/{n} windows")
    return np.concatenate(rows)


def eval_windows(stream: np.ndarray, n: int, seq: int) -> mx.array:
    starts = np.linspace(0, len(stream) - seq - 3, n).astype(np.int64)
    return mx.array(np.stack([stream[s : s + seq + 2] for s in starts]).astype(np.int32))


# ----------------------------------------------------------------------------- model


def text_config(args, vocab: int, eos: list[int]) -> dict:
    hd = args.head_dim
    half = int(hd * 0.25) // 2  # rotary pairs; split over M-RoPE's (t, h, w) rows like [11, 11, 10] of 32
    mrope = [-(-half * 11 // 32), -(-half * 11 // 32)]
    mrope.append(half - sum(mrope))
    return dict(
        hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=hd,
        rms_norm_eps=1e-6, vocab_size=vocab,
        linear_num_value_heads=args.gdn_v_heads, linear_num_key_heads=args.gdn_k_heads,
        linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
        full_attention_interval=4, tie_word_embeddings=True, max_position_embeddings=32768,
        attn_output_gate=True, mamba_ssm_dtype="float32", hidden_act="silu",
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(args.layers)],
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": mrope, "mrope_interleaved": True},
        eos_token_id=eos,
    )


def build(config: dict):
    from mlx_lm.models import qwen3_5
    from mlx_lm.utils import _get_classes

    config = copy.deepcopy(config)  # mlx-lm rewrites rope_parameters in place
    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    install_capturing_gdn(model.language_model.model.layers)
    head = MTPHead(model.language_model.args, qwen3_5.DecoderLayer)
    model.set_dtype(mx.float32)
    head.set_dtype(mx.float32)
    return model, head


def n_params(m: nn.Module) -> int:
    return sum(v.size for _, v in tree_flatten(m.parameters()))


# ----------------------------------------------------------------------------- state


def save_state(wd: Path, stage: str, module: nn.Module, opt, info: dict) -> None:
    mx.save_safetensors(str(wd / f"{stage}_model.safetensors"), dict(tree_flatten(module.parameters())))
    st = {k: v for k, v in tree_flatten(opt.state) if isinstance(v, mx.array)}
    mx.save_safetensors(str(wd / f"{stage}_opt.safetensors"), st)
    tmp = wd / f"{stage}_state.json.tmp"
    tmp.write_text(json.dumps(info, indent=1))
    tmp.replace(wd / f"{stage}_state.json")


def load_state(wd: Path, stage: str, module: nn.Module, opt):
    path = wd / f"{stage}_state.json"
    if not path.exists():
        return None
    info = json.loads(path.read_text())
    module.load_weights(list(mx.load(str(wd / f"{stage}_model.safetensors")).items()), strict=True)
    if opt is not None and (wd / f"{stage}_opt.safetensors").exists():
        opt.state = tree_unflatten(list(mx.load(str(wd / f"{stage}_opt.safetensors")).items()))
    return info


def lr_at(step: int, progress: float, peak: float, warmup: int, min_ratio: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    p = min(max(progress, 0.0), 1.0)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


# ----------------------------------------------------------------------------- stage 1


def backbone_loss(model, x):
    logits = model(x[:, :-2])
    return nn.losses.cross_entropy(logits, x[:, 1:-1], reduction="mean")


def eval_backbone(model, windows: mx.array, bs: int = 8) -> float:
    tot = 0.0
    for i in range(0, windows.shape[0], bs):
        tot += backbone_loss(model, windows[i : i + bs]).item() * min(bs, windows.shape[0] - i)
    return tot / windows.shape[0]


def run_stage1(args, model, data, wd: Path) -> dict:
    opt = optim.AdamW(learning_rate=args.lr, betas=[0.9, 0.95], weight_decay=args.wd)
    info = load_state(wd, "stage1", model, opt) or dict(step=0, elapsed=0.0, tokens=0, done=False, log=[])
    if info["done"]:
        log(f"stage 1: already done ({info['step']} steps)")
        return info
    if info["step"]:
        log(f"stage 1: resuming at step {info['step']} ({info['elapsed'] / 60:.1f} min used)")
    held = eval_windows(data["heldout"], args.eval_windows, args.seq)
    train_eval = eval_windows(data["train"], args.eval_windows, args.seq)
    budget = args.stage1_min * 60
    state = [model.state, opt.state]
    loss_and_grad = nn.value_and_grad(model, backbone_loss)

    def step(x):
        loss, grads = loss_and_grad(model, x)
        grads, gnorm = optim.clip_grad_norm(grads, args.clip)
        opt.update(model, grads)
        return loss, gnorm

    if args.compile:
        step = mx.compile(step, inputs=state, outputs=state)
    gen = batches(data["train"], args.batch, args.seq, seed=1000 + info["step"])
    t_start = time.time() - info["elapsed"]
    last_save = time.time()
    ema, tok_window, t_window = None, 0, time.time()
    model.train()
    while True:
        elapsed = time.time() - t_start
        if elapsed >= budget or (args.max_steps and info["step"] >= args.max_steps):
            break
        opt.learning_rate = lr_at(info["step"], elapsed / budget, args.lr, args.warmup, args.min_lr_ratio)
        x = next(gen)
        loss, gnorm = step(x)
        mx.eval(loss, gnorm, state)
        info["step"] += 1
        info["tokens"] += args.batch * args.seq
        tok_window += args.batch * args.seq
        lv = loss.item()
        ema = lv if ema is None else 0.95 * ema + 0.05 * lv
        if info["step"] % args.log_every == 0 or info["step"] == 1:
            tps = tok_window / (time.time() - t_window)
            tok_window, t_window = 0, time.time()
            log(f"s1 step {info['step']:5d} loss {lv:.3f} ema {ema:.3f} gnorm {gnorm.item():.2f} "
                f"lr {float(opt.learning_rate.item()):.2e} {tps:,.0f} tok/s  {elapsed / 60:.1f}/{budget / 60:.0f} min")
        if info["step"] % args.eval_every == 0:
            model.eval()
            hl = eval_backbone(model, held)
            model.train()
            info["log"].append(dict(step=info["step"], tokens=info["tokens"], train_ema=ema, heldout=hl,
                                    minutes=(time.time() - t_start) / 60))
            log(f"s1 step {info['step']:5d} held-out loss {hl:.3f}")
        if time.time() - last_save > args.save_every_min * 60:
            info["elapsed"] = time.time() - t_start
            save_state(wd, "stage1", model, opt, info)
            last_save = time.time()
    model.eval()
    info["elapsed"] = time.time() - t_start
    info["final_train_loss"] = eval_backbone(model, train_eval)
    info["final_heldout_loss"] = eval_backbone(model, held)
    info["done"] = True
    info["tokens_per_s"] = info["tokens"] / max(info["elapsed"], 1e-9)
    save_state(wd, "stage1", model, opt, info)
    log(f"stage 1 done: {info['step']} steps, {info['tokens']:,} tokens, train loss {info['final_train_loss']:.3f}, "
        f"held-out loss {info['final_heldout_loss']:.3f}, {info['tokens_per_s']:,.0f} tok/s")
    return info


# ----------------------------------------------------------------------------- stage 2


def teacher(model, x):
    """Post-norm hidden H [B,T,H] and the backbone's log-probs [B,T,V] for tokens x."""
    lm = model.language_model
    h = lm.model(x)
    logits = lm.model.embed_tokens.as_linear(h)
    return mx.stop_gradient(h), mx.stop_gradient(logits)


def head_losses(head, embed, H, T_logits, x, true_weight: float, chain_weights: tuple = ()):
    """Head losses at depth 1 and, chained on its own output, at depths 2.. (one weight each).

    Depth d: entry p = (out_{d-1}[p], emb(x[p+d])) (out_0 = H) is trained towards the
    backbone's distribution at p+d (its prediction of x[p+d+1]). Returns (loss, (d1 CE
    against the true token, d1 argmax agreement with the backbone)).
    """
    S = H.shape[1]
    loss, hidden, metrics = 0.0, H, None
    for d, weight in enumerate((1.0,) + tuple(chain_weights), start=1):
        n = S - d
        out = head(hidden[:, :n], embed(x[:, d : d + n]))
        logits = embed.as_linear(out)
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        soft = -(mx.softmax(T_logits[:, d : d + n], axis=-1) * logp).sum(-1).mean()
        hard = nn.losses.cross_entropy(logits, x[:, d + 1 : d + 1 + n], reduction="mean")
        loss = loss + weight * ((1 - true_weight) * soft + true_weight * hard)
        if d == 1:
            agree = (mx.argmax(logits, -1) == mx.argmax(T_logits[:, 1:S], -1)).astype(mx.float32).mean()
            metrics = (hard, agree)
        hidden = out
    return loss, metrics


def eval_head(model, head, windows: mx.array, bs: int = 8):
    embed = model.language_model.model.embed_tokens
    hard, agree, n = 0.0, 0.0, 0
    for i in range(0, windows.shape[0], bs):
        x = windows[i : i + bs]
        H, TL = teacher(model, x[:, :-1])
        _, (h1, a1) = head_losses(head, embed, H, TL, x, 0.0)
        k = x.shape[0]
        hard += h1.item() * k
        agree += a1.item() * k
        n += k
    return hard / n, agree / n


def run_stage2(args, model, head, data, wd: Path) -> dict:
    opt = optim.AdamW(learning_rate=args.head_lr, betas=[0.9, 0.95], weight_decay=args.wd)
    info = load_state(wd, "stage2", head, opt) or dict(step=0, elapsed=0.0, tokens=0, done=False, log=[])
    if info["done"]:
        log(f"stage 2: already done ({info['step']} steps)")
        return info
    model.freeze()
    model.eval()
    embed = model.language_model.model.embed_tokens
    held = eval_windows(data["heldout"], args.eval_windows, args.seq)
    budget = args.stage2_min * 60

    def loss_fn(head, H, TL, x):
        loss, _ = head_losses(head, embed, H, TL, x, args.head_true_weight, tuple(args.chain_weights))
        return loss

    loss_and_grad = nn.value_and_grad(head, loss_fn)
    state = [head.state, opt.state]

    def step(H, TL, x):
        loss, grads = loss_and_grad(head, H, TL, x)
        grads, gnorm = optim.clip_grad_norm(grads, args.clip)
        opt.update(head, grads)
        return loss, gnorm

    teach = teacher
    if args.compile:
        step = mx.compile(step, inputs=state, outputs=state)
        teach = mx.compile(lambda x: teacher(model, x))
    else:
        teach = lambda x: teacher(model, x)  # noqa: E731
    rollouts = None
    if args.on_policy_fraction > 0:
        path = wd / "rollouts.npy"
        if path.exists():
            rollouts = np.load(path)
        else:
            t0 = time.time()
            rollouts = greedy_rollouts(model, data["train"], args.rollouts, args.rollout_prompt, args.seq + 2 - args.rollout_prompt,
                                       args.rollout_batch, seed=args.seed + 77)
            np.save(path, rollouts)
            log(f"rollouts: {rollouts.size:,} tokens in {time.time() - t0:.0f}s")
    gen = mixed_batches(data["train"], rollouts, args.on_policy_fraction, args.head_batch, args.seq, seed=5000 + info["step"])
    t_start = time.time() - info["elapsed"]
    last_save = time.time()
    tok_window, t_window = 0, time.time()
    head.train()
    while True:
        elapsed = time.time() - t_start
        if elapsed >= budget or (args.max_steps and info["step"] >= args.max_steps):
            break
        opt.learning_rate = lr_at(info["step"], elapsed / budget, args.head_lr, args.head_warmup, args.min_lr_ratio)
        x = next(gen)
        H, TL = teach(x[:, :-1])
        loss, gnorm = step(H, TL, x)
        mx.eval(loss, gnorm, state)
        info["step"] += 1
        info["tokens"] += args.head_batch * args.seq
        tok_window += args.head_batch * args.seq
        if info["step"] % args.log_every == 0 or info["step"] == 1:
            tps = tok_window / (time.time() - t_window)
            tok_window, t_window = 0, time.time()
            log(f"s2 step {info['step']:5d} loss {loss.item():.3f} gnorm {gnorm.item():.2f} "
                f"lr {float(opt.learning_rate.item()):.2e} {tps:,.0f} tok/s  {elapsed / 60:.1f}/{budget / 60:.0f} min")
        if info["step"] % args.eval_every == 0:
            head.eval()
            hl, ag = eval_head(model, head, held)
            head.train()
            info["log"].append(dict(step=info["step"], heldout_ce=hl, heldout_agree=ag,
                                    minutes=(time.time() - t_start) / 60))
            log(f"s2 step {info['step']:5d} held-out head CE(x[p+2]) {hl:.3f}, teacher-forced agreement {ag:.3f}")
        if time.time() - last_save > args.save_every_min * 60:
            info["elapsed"] = time.time() - t_start
            save_state(wd, "stage2", head, opt, info)
            last_save = time.time()
    head.eval()
    info["elapsed"] = time.time() - t_start
    hl, ag = eval_head(model, head, held)
    info.update(final_heldout_ce=hl, final_heldout_agree=ag, done=True,
                tokens_per_s=info["tokens"] / max(info["elapsed"], 1e-9))
    save_state(wd, "stage2", head, opt, info)
    log(f"stage 2 done: {info['step']} steps, held-out head CE {hl:.3f}, teacher-forced agreement {ag:.3f}")
    return info


# ----------------------------------------------------------------------------- export


def export(args, model, head, config, tok, wd: Path, s1: dict, s2: dict) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for old in list(out.glob("*.safetensors")):
        old.unlink()
    weights = hf_weights(model, head, "qwen3_5")
    save_hf_checkpoint(out, weights, config, dtype=mx.bfloat16, mtp_shard=True)
    save_tokenizer(tok, out)
    eos = config["text_config"]["eos_token_id"]
    gen = dict(eos_token_id=eos, pad_token_id=tok.token_to_id("<|endoftext|>"), do_sample=False)
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    summary = dict(
        command=" ".join([Path(sys.executable).name] + sys.argv),
        config=dict(vars(args)),
        params_backbone=n_params(model), params_head=n_params(head),
        stage1={k: v for k, v in s1.items() if k != "log"}, stage2={k: v for k, v in s2.items() if k != "log"},
        stage1_log=s1.get("log", []), stage2_log=s2.get("log", []),
        data={k: v for k, v in json.loads((wd / "data_meta.json").read_text()).items() if k != "heldout_files"},
    )
    (wd / "train_summary.json").write_text(json.dumps(summary, indent=1))
    heldout = json.loads((wd / "data_meta.json").read_text())["heldout_files"]
    (out / "heldout_files.json").write_text(json.dumps(heldout, indent=1) + "\n")
    size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    log(f"exported to {out}: {size / 1e6:.1f} MB of safetensors; summary in {wd / 'train_summary.json'}")


# ----------------------------------------------------------------------------- main


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(REPO / "models" / "demo"))
    ap.add_argument("--work-dir", default=str(REPO / ".work" / "demo_train"))
    ap.add_argument("--data-dir", default=str(DEFAULT_SRC), help="directory tree of .py files (default: this stdlib)")
    ap.add_argument("--heldout-per-mille", type=int, default=20)
    ap.add_argument("--chat-fraction", type=float, default=0.2)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=192)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--intermediate", type=int, default=576)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--gdn-k-heads", type=int, default=2)
    ap.add_argument("--gdn-v-heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--head-batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--head-lr", type=float, default=2e-3)
    ap.add_argument("--wd", type=float, default=0.05)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--head-warmup", type=int, default=None, help="warmup steps of stage 2 (default: --warmup)")
    ap.add_argument("--min-lr-ratio", type=float, default=0.05)
    ap.add_argument("--head-true-weight", type=float, default=0.0,
                    help="weight of the true x[p+2] in the head loss (rest: backbone's soft next-next distribution)")
    ap.add_argument("--chain-weights", type=float, nargs="*", default=[0.3],
                    help="weights of the chained head losses at depth 2, 3, ... (none: depth 1 only)")
    ap.add_argument("--init-from", default=None,
                    help="start from this exported checkpoint (backbone, head and tokenizer), e.g. to retrain the head with --stages 2")
    ap.add_argument("--on-policy-fraction", type=float, default=0.0,
                    help="share of stage-2 rows taken from the backbone's own greedy rollouts")
    ap.add_argument("--rollouts", type=int, default=1024, help="greedy rollout windows generated for stage 2")
    ap.add_argument("--rollout-prompt", type=int, default=64, help="text tokens before each greedy rollout")
    ap.add_argument("--rollout-batch", type=int, default=32)
    ap.add_argument("--stage1-min", "--time-budget-min", type=float, default=47.0, dest="stage1_min",
                    help="wall-clock budget of stage 1 (backbone), minutes")
    ap.add_argument("--stage2-min", type=float, default=15.0, help="wall-clock budget of stage 2 (MTP head), minutes")
    ap.add_argument("--max-steps", type=int, default=0, help="per-stage step cap (smoke runs); 0: budget only")
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--eval-windows", type=int, default=32)
    ap.add_argument("--log-every", type=int, default=20)
    ap.add_argument("--save-every-min", type=float, default=5.0)
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stages", default="12", help="which stages to run: 1, 2 or 12; export after stage 2")
    return ap.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.head_warmup is None:
        args.head_warmup = args.warmup
    wd = Path(args.work_dir)
    wd.mkdir(parents=True, exist_ok=True)
    mx.random.seed(args.seed)
    log(f"mlx {mx.__version__}, backend {mtp_serve.BACKEND.note}")
    data = prepare_data(args)
    tok = data["tok"]
    vocab = tok.get_vocab_size()
    eos = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    config = hf_config("qwen3_5", text_config(args, vocab, eos))
    config["eos_token_id"] = eos
    (wd / "config.json").write_text(json.dumps(config, indent=2))
    model, head = build(config)
    if args.init_from:
        from mtp_serve.models.loader import load_model

        src = load_model(args.init_from)
        model.update(src.model.model.parameters())
        if src.model.head is not None:
            head.update(src.model.head.parameters())
        log(f"initialised backbone{' and head' if src.model.head is not None else ''} from {args.init_from}")
    log(f"params: backbone {n_params(model):,} (embedding {vocab * args.hidden:,}), head {n_params(head):,}")
    s1 = s2 = {}
    if "1" in args.stages:
        s1 = run_stage1(args, model, data, wd)
    if "2" in args.stages:
        if not s1:
            s1 = dict(init_from=args.init_from) if args.init_from else load_state(wd, "stage1", model, None)
        s2 = run_stage2(args, model, head, data, wd)
        model.unfreeze()
        export(args, model, head, config, tok, wd, s1, s2)


if __name__ == "__main__":
    main()
