"""mtp-tune: measure MTP on this machine and keep the depth that pays.

    mtp-tune MODEL [--max-depth 3] [--tune-tokens 96] [--tune-repeats 3] [--no-save]
                   [--draft-vocab-text FILE ...] [--draft-vocab N]

Loads the model and decodes a few built-in prompts greedily, plainly and at
each depth 1..max-depth (modes alternate, round-robin over the repeats, so
drift on a busy machine hits them alike). Reports whether MTP output equals
plain output, acceptance per draft position and decode speed against plain
(best of the repeats: other work on the machine only ever adds time); prints
a table and a verdict, and stores the chosen depth as `default_mtp_depth` in
the model's `mtp_serve.json` (0: MTP does not pay here), which mtp-serve and
mtp-generate use by default. It also measures what verify windows of 4 to 33
tokens (copied drafts) cost in plain steps, stored as `window_costs`, which the
depth policy starts from when it chooses copy lengths. `mtp-graft` and `mtp-convert` run the same
check after writing.

`--draft-vocab-text FILE ...` first measures the checkpoint's draft vocabulary
(token frequencies over the files, special tokens first) into `draft_vocab.json`;
`--draft-vocab N` tunes with drafts from the N most frequent tokens and stores N
as the model's `draft_vocab_size`.

For a quantized body it first chooses the drafts (mtp_serve/cli/draft_choice.py):
the cheapest head precision and draft vocabulary whose acceptance stays within 5%
of the unquantized head's over the whole vocabulary, stored as `draft_head_bits`
and `draft_vocab_size` (the vocabulary: the checkpoint's draft_vocab.json, else the
tokenizer's order, written there); `--no-draft-choice` keeps the drafts as they are.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Tuple

from mtp_serve import BACKEND
from mtp_serve.cli.common import OneLineParser, encode_prompt, fail
from mtp_serve.cli.progress import hub_progress, stage, tensor_writes
from mtp_serve.cli.progress import progress as show_progress

if TYPE_CHECKING:
    from mtp_serve.cli.draft_choice import DraftChoice

# (text, wrap in the chat template): code, as agents and the demo model write it, and chat.
PROMPTS: Tuple[Tuple[str, bool], ...] = (
    ('def merge_sorted(a, b):\n    """Merge two sorted lists into one sorted list."""\n', False),
    ("class LRUCache:\n    def __init__(self, capacity):\n", False),
    ("Explain in two sentences what a hash table is.", True),
)
MIN_GAIN = 1.05  # a depth must beat plain by this much to be worth turning on
LOW_ACCEPTANCE = 0.2
NOISY = 1.3  # repeats of one run differing more than this: say the machine was busy
BROKEN_HEAD_CAUSES = (
    "its RMSNorm weights shifted twice or not at all (graft again with --force, and --norms raw|shifted "
    "if the detected format was wrong); a quantized head (graft without --quantize-head); a head from another "
    "model or revision than the body; or the wrong hidden fed to it (mtp_hidden in mtp_serve.json: "
    "post_norm or pre_norm)"
)


@dataclass
class ModeRun:
    depth: int  # 0 = plain
    tokens: Dict[int, int] = field(default_factory=dict)  # prompt -> decoded tokens (after the prefill's first)
    seconds: Dict[int, List[float]] = field(default_factory=dict)  # prompt -> decode time of each repeat
    passes: int = 0
    runs: int = 0
    drafted: List[int] = field(default_factory=list)
    accepted: List[int] = field(default_factory=list)
    outputs: Dict[int, List[int]] = field(default_factory=dict)  # prompt -> greedy ids (first repeat)

    @property
    def tok_s(self) -> float:
        """Best-of-repeats speed: interference from other work only ever adds time."""
        best = sum(min(s) for s in self.seconds.values())
        return sum(self.tokens.values()) / best if best else 0.0

    @property
    def tokens_per_pass(self) -> float:
        return sum(self.tokens.values()) * self.runs / len(self.tokens) / self.passes if self.passes else 1.0

    @property
    def acceptance(self) -> List[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted, self.drafted)]

    @property
    def spread(self) -> float:
        """How much repeats of the same run differed (slowest / fastest)."""
        return max((max(s) / min(s) for s in self.seconds.values() if min(s) > 0), default=1.0)

    def add(self, prompt: int, stats: dict) -> None:
        self.tokens[prompt] = stats["generated_tokens"] - 1
        self.seconds.setdefault(prompt, []).append(stats["decode_s"])
        self.passes += stats["backbone_passes"]
        self.runs += 1
        for j, (d, a) in enumerate(zip(stats["drafted_per_position"], stats["accepted_per_position"])):
            if j == len(self.drafted):
                self.drafted.append(0)
                self.accepted.append(0)
            self.drafted[j] += d
            self.accepted[j] += a


@dataclass
class Measurement:
    modes: Dict[int, ModeRun]
    max_tokens: int
    repeats: int

    def ratio(self, depth: int) -> float:
        plain = self.modes[0].tok_s
        return self.modes[depth].tok_s / plain if plain else 0.0

    def identical(self, depth: int) -> Tuple[int, int]:
        plain, run = self.modes[0].outputs, self.modes[depth].outputs
        return sum(run[p] == plain[p] for p in plain), len(plain)

    @property
    def depths(self) -> List[int]:
        return sorted(d for d in self.modes if d)

    @property
    def spread(self) -> float:
        return max(run.spread for run in self.modes.values())


@dataclass
class Verdict:
    depth: int  # the depth to use by default; 0 = off
    text: str
    broken: bool = False
    notes: List[str] = field(default_factory=list)


def measure(lm, max_depth: int, max_tokens: int, repeats: int, progress: Callable[[str], None] = lambda _: None) -> Measurement:
    """Greedy decoding of the built-in prompts, plain and at depths 1..max_depth."""
    from mtp_serve.engine.generator import generate
    from mtp_serve.engine.sampling import SamplingParams
    from mtp_serve.engine.warmup import calibrate_blas_threads

    prompts = [encode_prompt(lm.tokenizer, text, chat and lm.tokenizer.chat_template is not None) for text, chat in PROMPTS]
    modes = {d: ModeRun(d) for d in range(max_depth + 1)}
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)

    def run(depth: int, prompt: List[int], n: int = max_tokens) -> Tuple[List[int], dict]:
        p = params if n == max_tokens else SamplingParams(max_tokens=n, ignore_eos=True)
        chunks = list(generate(lm.model, lm.tokenizer, prompt, p, depth))
        return [t for c in chunks for t in c.token_ids], chunks[-1].stats.as_dict()

    progress("warming up (the first run on a machine also compiles kernels)")
    with stage("warming up every decode path, then timing decode matmuls"):
        for depth in modes:  # compile every path once, untimed
            run(depth, prompts[0], 8)
        calibrate_blas_threads(lm.model, lm.tokenizer, max_depth)  # as mtp-serve does at start-up
    for r in range(repeats):
        order = list(modes) if r % 2 == 0 else list(reversed(modes))
        progress(f"repeat {r + 1}/{repeats}")
        runs = [(i, prompt, depth) for i, prompt in enumerate(prompts) for depth in order]
        for i, prompt, depth in show_progress(runs, f"    repeat {r + 1}/{repeats}: runs"):
            ids, stats = run(depth, prompt)
            modes[depth].add(i, stats)
            modes[depth].outputs.setdefault(i, ids)
    return Measurement(modes, max_tokens, repeats)


def verdict(m: Measurement) -> Verdict:
    drafted = sum(sum(m.modes[d].drafted) for d in m.depths)
    accepted = sum(sum(m.modes[d].accepted) for d in m.depths)
    if drafted and not accepted:
        return Verdict(0, f"the MTP head is broken: 0 of {drafted} drafted tokens were accepted. That is the head, "
                          f"not a slow machine. Likely causes: {BROKEN_HEAD_CAUSES}. MTP stays off.", broken=True)
    best = max(m.depths, key=m.ratio)
    ratio = m.ratio(best)
    if ratio >= MIN_GAIN:
        v = Verdict(best, f"depth {best}: {ratio:.2f}x plain, use it")
    else:
        v = Verdict(0, f"MTP is slower here (best: depth {best} at {ratio:.2f}x plain): leave it off")
    first = m.modes[m.depths[0]].acceptance[0] if m.modes[m.depths[0]].drafted else 0.0
    if first < LOW_ACCEPTANCE:
        v.notes.append(f"acceptance at the first draft position is only {first:.2f} (a working head: 0.5-0.9). "
                       f"Likely causes: {BROKEN_HEAD_CAUSES}")
    if m.spread > NOISY:
        v.notes.append(f"repeats of the same run differed by up to {m.spread:.1f}x: this machine was busy while "
                       "measuring (speeds are best of the repeats); the verdict may change on a quieter run")
    differing = [d for d in m.depths if m.identical(d)[0] != m.identical(d)[1]]
    if differing:
        v.notes.append(f"MTP output differed from plain at depth(s) {', '.join(map(str, differing))}: a near-tie "
                       "between the top two logits can flip a greedy token (verify and step use different matmul "
                       "shapes); a difference that persists in fp32 is a bug: please report it")
    return v


def table(m: Measurement) -> str:
    rows = [("mode", "tok/s", "vs plain", "tokens/pass", "acceptance by position", "greedy = plain")]
    for d, run in sorted(m.modes.items()):
        same, n = m.identical(d)
        rows.append((
            f"depth {d}" if d else "plain", f"{run.tok_s:.1f}", f"{m.ratio(d):.2f}x", f"{run.tokens_per_pass:.2f}",
            " ".join(f"{a:.2f}" for a in run.acceptance) if d else "-", f"{same}/{n}" if d else "-",
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) if i in (0, 4) else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
                     for r in rows)


def save_choice(model_dir: Path, v: Verdict, m: Measurement, draft_vocab: Optional[int] = None,
                drafts: Optional["DraftChoice"] = None, window_costs: Optional[Dict[int, float]] = None) -> Path:
    """Merge `default_mtp_depth` (and what it was measured from; `draft_vocab_size` when
    tuned with one; `draft_head_bits` and the acceptance behind them when the drafts were
    chosen; `window_costs`, the verify windows' costs in plain steps) into the model's
    mtp_serve.json."""
    from mtp_serve.models.model_card import CHECKPOINT_CARD_FILE

    path = Path(model_dir) / CHECKPOINT_CARD_FILE
    try:
        data = json.loads(path.read_text()) if path.exists() else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e}); fix or delete it") from e
    data["default_mtp_depth"] = v.depth
    if draft_vocab is not None:
        data["draft_vocab_size"] = draft_vocab
    if drafts is not None:
        data["draft_head_bits"] = drafts.setting.head_bits
        data["draft_choice"] = drafts.as_dict()
    if window_costs:
        data["window_costs"] = {str(w): c for w, c in sorted(window_costs.items())}
    data["mtp_tune"] = {
        "verdict": v.text,
        "speed_vs_plain": {str(d): round(m.ratio(d), 3) for d in m.depths},
        "acceptance_by_position": [round(a, 3) for a in m.modes[m.depths[-1]].acceptance],
        "greedy_identical": {str(d): "{}/{}".format(*m.identical(d)) for d in m.depths},
        "tokens": m.max_tokens, "repeats": m.repeats, "backend": BACKEND.note,
        "measured": datetime.datetime.now().isoformat(timespec="seconds"),
    }
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def add_tune_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-depth", type=int, default=3, help="measure depths 1..N (default 3)")
    p.add_argument("--tune-tokens", type=int, default=96, help="tokens decoded per prompt and mode (default 96)")
    p.add_argument("--tune-repeats", type=int, default=3, help="round-robin repeats over the modes (default 3)")
    p.add_argument("--draft-vocab-text", nargs="+", metavar="FILE", help="measure the checkpoint's draft vocabulary "
                   "(token frequencies over these text files) into draft_vocab.json first")
    p.add_argument("--draft-vocab", type=int, metavar="N", help="tune with drafts from the N most frequent tokens and "
                   "store N as the model's draft_vocab_size (0: the whole vocabulary)")
    p.add_argument("--no-draft-choice", action="store_true", help="keep the drafts as they are (default for a "
                   "quantized body: the cheapest head precision and draft vocabulary within 5%% of the unquantized "
                   "head's acceptance, measured here and stored)")
    p.add_argument("--quantized-matmul", choices=("exact", "int8"),
                   help="numerics of a quantized model's decode matmuls, as mtp-serve's flag (default: mtp-serve's)")


def check_tune_arguments(args) -> Optional[str]:
    if not 1 <= args.max_depth <= 8:
        return "--max-depth must be between 1 and 8"
    if args.tune_tokens < 4 or args.tune_repeats < 1:
        return "--tune-tokens must be at least 4 and --tune-repeats at least 1"
    if args.draft_vocab is not None and args.draft_vocab < 0:
        return "--draft-vocab must be 0 (the whole vocabulary) or a number of tokens"
    return None


def measure_and_store_draft_vocab(lm, files: List[str], save: bool, out: Callable[[str], None]) -> List[int]:
    """Token ids by frequency over `files` (the special tokens first: a chat turn's end
    must stay draftable), stored with the checkpoint unless `save` is off."""
    from mtp_serve.models.draft_vocab import measure_draft_vocab, save_draft_vocab
    from mtp_serve.models.mlx_lm_compat import hf_tokenizer

    texts = [Path(f).read_text(errors="replace") for f in files]
    special = list(lm.tokenizer.eos_token_ids) + list(hf_tokenizer(lm.tokenizer).all_special_ids)
    ids = measure_draft_vocab(lambda t: lm.tokenizer.encode(t, add_special_tokens=False), texts, always=special)
    note = f"draft vocabulary: {len(ids)} distinct tokens over {len(files)} file(s)"
    if save:
        note += f", stored in {save_draft_vocab(lm.path, ids, 'token frequencies of ' + ', '.join(Path(f).name for f in files))}"
    out(note)
    return ids


def body_quantization(lm) -> Optional[dict]:
    return lm.config.get("quantization") or lm.config.get("text_config", {}).get("quantization")


def draft_ids(lm, args, save: bool, out: Callable[[str], None]) -> Optional[List[int]]:
    """The checkpoint's draft vocabulary, most frequent first: measured on the user's text
    (--draft-vocab-text), the one stored with the checkpoint, else the tokenizer's order
    (None without any: a model whose vocabulary no draft subset would shrink)."""
    from mtp_serve.models.draft_vocab import load_draft_ids

    if args.draft_vocab_text:
        return measure_and_store_draft_vocab(lm, args.draft_vocab_text, save, out)
    return load_draft_ids(lm.path, lm.model.vocab_size)


def tokenizer_draft_ids(lm) -> List[int]:
    from mtp_serve.models.draft_vocab import tokenizer_order
    from mtp_serve.models.mlx_lm_compat import hf_tokenizer

    special = list(lm.tokenizer.eos_token_ids) + list(hf_tokenizer(lm.tokenizer).all_special_ids)
    return tokenizer_order(lm.model.vocab_size, always=special)


def pick_drafts(lm, args, ids: Optional[List[int]], save: bool, out: Callable[[str], None]):
    """Measure and put in place the cheapest drafts within the acceptance margin
    (mtp_serve/cli/draft_choice.py); returns the choice."""
    from mtp_serve.cli.draft_choice import MARGIN, choose_drafts
    from mtp_serve.models.draft_head import group_size_of
    from mtp_serve.models.draft_vocab import DRAFT_VOCAB_FILE, save_draft_vocab

    quant = body_quantization(lm)
    stored = ids is not None
    ids = ids if stored else tokenizer_draft_ids(lm)
    prompts = [encode_prompt(lm.tokenizer, text, chat and lm.tokenizer.chat_template is not None) for text, chat in PROMPTS]
    out(f"choosing the drafts: acceptance at depth {args.max_depth} against the unquantized head over the whole "
        f"vocabulary, the cheapest within {MARGIN:.0%} of it")
    choice = choose_drafts(lm, ids, prompts, args.max_depth, args.tune_tokens, int(quant.get("bits", 0)),
                           group_size_of(quant), fixed_vocab=args.draft_vocab, out=out)
    out(f"drafts: {choice.setting.describe()}")
    if choice.setting.vocab and not stored and save:
        path = save_draft_vocab(lm.path, ids, "the tokenizer's order (byte-pair merges, most frequent first)")
        out(f"draft vocabulary: the tokenizer's order, stored in {path}")
    elif choice.setting.vocab and not stored:
        out(f"(--no-save: {DRAFT_VOCAB_FILE} not written)")
    return choice


def verify_and_tune(model: str, args, save: bool = True, out: Callable[[str], None] = print) -> Verdict:
    """Load `model`, choose its drafts (a quantized body), measure, print the table and
    verdict, store the choice. Raises CheckpointError for a model that cannot be loaded
    or has no MTP head."""
    from mtp_serve.engine.window_costs import measure_window_costs
    from mtp_serve.models.draft_head import group_size_of, head_is_quantized, quantized_head
    from mtp_serve.models.loader import CheckpointError, load_model

    draft_vocab = args.draft_vocab
    if getattr(args, "quantized_matmul", None):
        from mtp_serve import quantized_matmul

        quantized_matmul.set_numerics(args.quantized_matmul)
    lm = load_model(model, enable_mtp=True, draft_vocab=draft_vocab, draft_head_bits=0)
    if not lm.model.has_mtp:
        raise CheckpointError(f"{lm.path}: {lm.mtp_status}; add the head with: {lm.mtp_fix}")
    quant = body_quantization(lm)
    choosing = bool(quant) and not getattr(args, "no_draft_choice", False) and not head_is_quantized(lm.model.head)
    ids = draft_ids(lm, args, save, out)
    choice = None
    if choosing:
        choice = pick_drafts(lm, args, ids, save, out)
        draft_vocab = choice.setting.vocab
    else:
        if ids is not None and args.draft_vocab_text:
            size = lm.card.draft_vocab_size if draft_vocab is None else draft_vocab
            lm.model.use_draft_vocab(ids[:size] if size else None)
        if lm.card.draft_head_bits and not head_is_quantized(lm.model.head):  # as mtp-serve will draft
            lm.model.head = quantized_head(lm.model.head, lm.card.draft_head_bits, group_size_of(quant))
    if lm.model.draft_vocab is not None:
        out(f"drafting from the {lm.model.draft_vocab.size} most frequent tokens of {lm.model.vocab_size}")
    if quant:
        from mtp_serve import quantized_matmul

        out(quantized_matmul.status())  # as mtp-serve will decode it: its kernel, or why MLX's
    out(f"verifying and tuning MTP on {lm.path} ({BACKEND.note}); {len(PROMPTS)} prompts x {args.tune_tokens} "
        f"tokens x {args.tune_repeats} repeats, modes alternating")
    m = measure(lm, args.max_depth, args.tune_tokens, args.tune_repeats, progress=lambda s: out(f"  {s}"))
    v = verdict(m)
    out(table(m))
    costs = measure_window_costs(lm.model)
    out("verify windows (copied drafts), in plain steps: " + ", ".join(f"{w} tokens {c:.2f}" for w, c in costs.items()))
    out(f"verdict: {v.text}")
    for note in v.notes:
        out(f"note: {note}")
    if v.broken and lm.model.draft_vocab is not None and choice is None:  # a choice measured the whole vocabulary too
        out(f"note: drafts came from {lm.model.draft_vocab.size} tokens only; a draft vocabulary measured on text "
            "unlike the model's output also gives this: try --draft-vocab 0")
    if save:
        path = save_choice(lm.path, v, m, draft_vocab, choice, costs)
        stored = f"default_mtp_depth={v.depth}"
        if choice is not None:
            stored += f", draft_head_bits={choice.setting.head_bits}, draft_vocab_size={choice.setting.vocab}"
        out(f"stored {stored} in {path} (mtp-serve and mtp-generate use it by default)")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="mtp-tune", description="Measure MTP against plain decoding on this machine and store the depth that pays.")
    p.add_argument("model", help="model directory or Hugging Face repo id (with its MTP head)")
    add_tune_arguments(p)
    p.add_argument("--no-save", action="store_true", help="print the table and verdict only; leave mtp_serve.json alone")
    return p


def run_command(prog: str, parser: argparse.ArgumentParser, argv, body: Callable[[argparse.Namespace], int]) -> int:
    """Parse, check the tune options, run `body(args)`; checkpoint and file errors
    become one-line failures (the frame mtp-tune, mtp-graft and mtp-convert share)."""
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    problem = check_tune_arguments(args)
    if problem:
        return fail(prog, problem)
    hub_progress()  # download bars on a terminal only
    try:
        with tensor_writes():  # each shard named while it is written (on a terminal)
            return body(args)
    except (ValueError, OSError) as e:  # CheckpointError is a ValueError
        return fail(prog, str(e))


def exit_status(v: Verdict) -> int:
    return 3 if v.broken else 0


def main(argv=None) -> int:
    return run_command("mtp-tune", build_parser(), argv,
                       lambda args: exit_status(verify_and_tune(args.model, args, save=not args.no_save)))


if __name__ == "__main__":
    sys.exit(main())
