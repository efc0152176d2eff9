"""Byte-level BPE tokenizer for the demo model.

A Qwen2-style tokenizer in miniature: the same pre-tokenizer (Qwen's split
regex, then GPT-2 byte-to-unicode mapping), a BPE vocabulary trained on the
demo model's training text, and Qwen's special tokens added after the
regular vocabulary (as in the real checkpoints, where they sit above the
merges). Saved through transformers' `PreTrainedTokenizerFast`, so
`tokenizer.json`, `tokenizer_config.json` (with the chat template embedded)
and `special_tokens_map.json` are what `AutoTokenizer` and mlx-lm load.

    from mtp_serve.testing.tokenizer_builder import train_tokenizer, save_tokenizer
    tok = train_tokenizer(texts, vocab_size=4096)
    save_tokenizer(tok, "models/demo", chat_template=open(".../chat_template.jinja").read())
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Optional

from mtp_serve.testing.synthetic import QWEN_SPECIAL_TOKENS

# Qwen2/Qwen3/Qwen3.5 pre-tokenizer split pattern (single digits, letters with
# an optional leading non-letter, punctuation runs, newline runs, spaces).
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# As in the real Qwen tokenizers, only the ChatML control tokens are "special"
# (dropped by skip_special_tokens); <think>, <tool_call>, <tool_response> and
# their closers are added tokens that stay in the decoded text, so reasoning
# and tool-call parsers can see them.
CONTROL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
DEFAULT_TEMPLATE_PATH = Path(__file__).parent / "demo" / "chat_template.jinja"


def train_tokenizer(texts: Iterable[str], vocab_size: int = 4096, min_frequency: int = 2):
    """Train a byte-level BPE on `texts`; the result has exactly `vocab_size` ids.

    The regular vocabulary (256 byte symbols plus merges) takes
    `vocab_size - len(QWEN_SPECIAL_TOKENS)` ids; the special tokens follow, in
    QWEN_SPECIAL_TOKENS order.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    n_regular = vocab_size - len(QWEN_SPECIAL_TOKENS)
    trainer = trainers.BpeTrainer(
        vocab_size=n_regular,
        min_frequency=min_frequency,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    if tok.get_vocab_size() != n_regular:  # tiny corpora run out of merges
        raise ValueError(f"training text too small: got {tok.get_vocab_size()} regular tokens, wanted {n_regular}")
    return mark_special(tok, add=True)


def mark_special(tok, add: bool = False):
    """Add (or re-flag) QWEN_SPECIAL_TOKENS: control tokens special, the rest not."""
    import json

    from tokenizers import AddedToken, Tokenizer

    if add:
        tok.add_tokens([AddedToken(t, special=t in CONTROL_TOKENS, normalized=False, single_word=False,
                                   lstrip=False, rstrip=False) for t in QWEN_SPECIAL_TOKENS])
        return tok
    data = json.loads(tok.to_str())
    for entry in data.get("added_tokens", []):
        if entry["content"] in QWEN_SPECIAL_TOKENS:
            entry["special"] = entry["content"] in CONTROL_TOKENS
            entry["normalized"] = False
    return Tokenizer.from_str(json.dumps(data))


def save_tokenizer(tok, out_dir, chat_template: Optional[str] = None, model_max_length: int = 32768):
    """Write the HF tokenizer files (eos `<|im_end|>`, pad `<|endoftext|>`) and the template."""
    from transformers import PreTrainedTokenizerFast

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if chat_template is None and DEFAULT_TEMPLATE_PATH.exists():
        chat_template = DEFAULT_TEMPLATE_PATH.read_text()
    tok = mark_special(tok)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[t for t in CONTROL_TOKENS if t not in (EOS_TOKEN, PAD_TOKEN)],
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(str(out_dir))
    if chat_template is not None:
        # transformers >= 4.45 may write the template only to chat_template.jinja;
        # keep it embedded in tokenizer_config.json too, for older loaders.
        import json

        cfg_path = out_dir / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text())
        if cfg.get("chat_template") != chat_template:
            cfg["chat_template"] = chat_template
            cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    return fast


def load_tokenizer_json(path):
    """The raw `tokenizers.Tokenizer` from a saved `tokenizer.json`."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))
