"""qwen4_exp (Qwen3.8-Flash-Next): the project's own backbone against transformers' forward
(text, and a prompt with an image), its caches' rollback, and the parts that refuse until they
are built.

The goldens (tests/data/qwen4_exp_golden.npz) are transformers' `Qwen4ExpForConditionalGeneration` logits
(float32, eager attention) on the committed tiny checkpoint tests/data/qwen4_exp_tiny, written by
tests/support/make_qwen4_exp_golden.py (torch is needed only to regenerate them).
"""

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mtp_serve.models import qwen4_exp
from mtp_serve.models.caches import keep_verified, set_capture
from mtp_serve.models.loader import CheckpointError, load_model, load_weights
from mtp_serve.testing.synthetic import write_synthetic_checkpoint

DATA = Path(__file__).parent / "data"
CKPT = DATA / "qwen4_exp_tiny"
# float32 on both sides; measured max |diff| 2.7e-7 on logits of size ~0.8
ATOL = 2e-5


@pytest.fixture(scope="module")
def golden():
    return np.load(DATA / "qwen4_exp_golden.npz")


@pytest.fixture(scope="module")
def backbone():
    config = json.loads((CKPT / "config.json").read_text())
    model = qwen4_exp.build(config)
    body = {k: v.astype(mx.float32) for k, v in load_weights(CKPT).items() if not k.startswith(("mtp.", "model.visual."))}
    model.load_weights(list(model.sanitize(body).items()), strict=True)
    return model


@pytest.fixture(scope="module")
def lm():
    return load_model(str(CKPT), dtype="float32")


@pytest.mark.parametrize("prompt", ["a", "b"])
def test_prefill_logits_match_transformers(prompt, golden, lm):
    tokens = mx.array(golden[f"{prompt}_tokens"])[None]
    _, logits = lm.model.forward(tokens, lm.model.make_cache())
    np.testing.assert_allclose(np.array(logits[0]), golden[f"{prompt}_prefill"], atol=ATOL, rtol=0)


@pytest.mark.parametrize("prompt", ["a", "b"])
def test_chunked_and_stepwise_logits_match_transformers_with_its_cache(prompt, golden, lm):
    """Fed in chunks of 1-7 tokens, as transformers was with its cache: the PLE n-gram and
    conv windows, the GatedDeltaNet states and the indexer's keys carry across calls."""
    tokens, cache, out, start = mx.array(golden[f"{prompt}_tokens"])[None], lm.model.make_cache(), [], 0
    for n in golden[f"{prompt}_chunks"].tolist():
        out.append(np.array(lm.model.forward(tokens[:, start : start + n], cache)[1][0]))
        start += n
    np.testing.assert_allclose(np.concatenate(out), golden[f"{prompt}_steps"], atol=ATOL, rtol=0)


def test_the_golden_prompts_exercise_every_part(golden, backbone):
    """The comparison would catch a missing part: the indexer leaves some queries a strict
    subset of their causal keys, the prompt crosses an EOS, and dropping PLE or the indexer
    moves the logits far past the tolerance."""
    tokens = mx.array(golden["a_tokens"])[None]
    assert 257 in golden["a_tokens"].tolist()
    attn = next(l.self_attn for l in backbone.layers if not l.is_linear)
    x = mx.random.normal((1, tokens.shape[1], backbone.args.hidden_size), key=mx.random.key(0))
    sel = attn.indexer.selection(x, 0, None)[0, 0]
    causal = mx.tril(mx.ones(sel.shape, mx.bool_))
    assert bool(mx.all(sel <= causal)) and int(sel.sum()) < int(causal.sum())
    base = np.array(backbone(tokens)[0])
    owners = {"indexer": [l.self_attn for l in backbone.layers if not l.is_linear],
              "ple": [l for l in backbone.layers if l.has_ple]}
    for part, modules in owners.items():
        saved = [m[part] for m in modules]
        for m in modules:
            del m[part]
        try:
            assert np.abs(np.array(backbone(tokens)[0]) - base).max() > 100 * ATOL, part
        finally:
            for m, s in zip(modules, saved):
                m[part] = s


def test_top_blocks_breaks_ties_toward_recent_blocks():
    scores = mx.array([[0.0, 0.0, 0.0, 0.9], [0.5, 0.0, 0.2, 0.0], [1.0, 1.0, 1.0, 1.0]])
    got = qwen4_exp.top_blocks(scores, 2).tolist()
    assert got == [[False, False, True, True], [True, False, True, False], [False, False, True, True]]


def test_ngram_table_rows_are_prime_sized_per_head():
    args = qwen4_exp.Qwen4ExpArgs.from_config(json.loads((CKPT / "config.json").read_text()))
    sizes = qwen4_exp.head_vocab_sizes(args.ngram_vocab_size_base, 0, 8)
    assert sizes[:3] == [1009, 1013, 1019] and all(qwen4_exp._is_prime(s) for s in sizes)
    assert qwen4_exp.ngram_table_rows(args, 0) % args.make_ngram_vocab_size_divisible_by == 0


@pytest.mark.parametrize("kept", [1, 2, 4])
def test_a_rejected_verify_rolls_every_state_back_to_plain_steps(kept, lm):
    """A captured verify of 4 tokens cut at `kept`: the GatedDeltaNet state, the PLE n-gram and
    conv windows and the indexed KV (with the indexer's keys) equal those of plain steps over
    the kept tokens, and the next logits match bit for bit."""
    model = lm.model
    prompt, window, nxt = [5, 17, 257, 3, 42, 7, 9, 250, 11], [12, 13, 14, 15], 99
    spec, plain = model.make_cache(), model.make_cache()
    model.forward(mx.array([prompt]), spec)
    model.forward(mx.array([prompt]), plain)
    set_capture(spec, True)
    model.forward(mx.array([window]), spec)
    set_capture(spec, False)
    keep_verified(spec, [kept], len(window))
    for t in window[:kept]:
        model.forward(mx.array([[t]]), plain)
    for a, b in zip(spec, plain):
        if isinstance(a, qwen4_exp.IndexKeys):
            n = a.offset
            assert n == b.offset == len(prompt) + kept
            for x, y in [(a.keys[:, :, :n], b.keys[:, :, :n]), (a.values[:, :, :n], b.values[:, :, :n]),
                         (a.index_keys[:, :n], b.index_keys[:, :n])]:
                assert mx.allclose(x, y, atol=1e-6)
        else:
            for x, y in zip(a.cache, b.cache):
                assert mx.allclose(x, y, atol=1e-6)
            if a.ple is not None:
                assert mx.array_equal(a.ple.ngram, b.ple.ngram) and mx.allclose(a.ple.conv, b.ple.conv, atol=1e-6)
    la = model.forward(mx.array([[nxt]]), spec)[1]
    lb = model.forward(mx.array([[nxt]]), plain)[1]
    assert mx.allclose(la, lb, atol=1e-5)


def test_start_up_line_reports_the_ngram_tables(lm):
    args = lm.model.text.args
    rows = qwen4_exp.ngram_table_rows(args, 0) + qwen4_exp.ngram_table_rows(args, 1)
    # two PLE layers of 8-wide rows, bfloat16 in the files (mapped as stored)
    assert lm.model.ngram_table_bytes() == rows * 8 * 2
    assert lm.model.memory_note() == f"PLE n-gram tables {rows * 16 / 2**20:.1f} MiB memory-mapped; "


def test_ngram_tables_are_memory_mapped_and_read_as_loaded_ones(lm, backbone, golden):
    """The loaded model holds no n-gram table in memory (each PLE layer reads rows from a memmap
    of the files), and the rows it reads are bit for bit those of the tables loaded into memory (the goldens
    above check its logits against transformers)."""
    from mlx.utils import tree_flatten

    from mtp_serve.models.ngram_tables import MappedTable

    assert qwen4_exp.tables_mapped(lm.model.inner)
    assert not any("ngram_embedding" in k for k, _ in tree_flatten(lm.model.inner.parameters()))
    layers = [l.ple.ple_embedding for l in lm.model.layers if l.has_ple]
    assert all(isinstance(e.mapped, MappedTable) and len(e.mapped.shards) == 4 for e in layers)
    assert all(isinstance(s, np.memmap) for e in layers for s in e.mapped.shards)
    assert not qwen4_exp.tables_mapped(backbone)
    loaded_in_memory = [l.ple.ple_embedding for l in backbone.layers if l.has_ple]
    for mapped, ref in zip(layers, loaded_in_memory):
        rows = mx.array(np.random.default_rng(0).integers(0, mapped.mapped.shape[0], (2, 9, 4)))
        assert mx.array_equal(mapped.mapped.take(rows), ref.ngram_embedding(rows)).item()  # every shard's rows
        history = mx.array(golden["a_tokens"])[None]
        assert mx.array_equal(mapped(history, 5), ref(history, 5)).item()
    assert lm.mtp_status == "MTP on"
    from mtp_serve.engine.prompt_cache.setup import snapshot_costs

    assert snapshot_costs(lm.model).kv_bytes_per_token == lm.model.kv_bytes_per_token()  # indexer keys included


def test_parts_not_built_yet_refuse_by_name(lm, tmp_path):
    from mtp_serve.engine.prompt_cache.setup import check_round_trip, open_prompt_cache

    check_round_trip(lm.model)  # the prompt cache snapshots and restores every state
    cache = open_prompt_cache(lm, "m", max_bytes=1 << 20, disk_dir=str(tmp_path / "disk"))
    assert cache is not None and cache.disk is not None  # the disk tier keeps them too
    cache.close()
    # a quantized (mlx-community) body
    q = tmp_path / "q"
    shutil.copytree(CKPT, q)
    extra = {"model.language_model.layers.0.mlp.gate.scales": mx.zeros((8, 1))}
    mx.save_safetensors(str(q / "extra.safetensors"), extra)
    index = json.loads((q / "model.safetensors.index.json").read_text())
    index["weight_map"].update({k: "extra.safetensors" for k in extra})
    (q / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="qwen4_exp: a quantized .* is not supported yet"):
        load_model(str(q))


def _image_inputs(golden, lm):
    """The golden image prompt as the engine feeds it: tokens, embeddings with the tower's
    features at the image tokens, multimodal positions and the shift after the image."""
    from mtp_serve.models.vision import PreparedImage, mrope_positions

    vision = lm.model.vision
    tokens = golden["img_tokens"].tolist()
    grid = tuple(int(x) for x in golden["img_grid"])
    image = PreparedImage(golden["img_pixels"], grid, "0" * 64, vision.spec.spatial_merge_size)
    features = vision.encode([image])[0]
    at = tokens.index(vision.spec.image_token_id)
    embeds = lm.model.inner.embed_tokens(mx.array(tokens))
    embeds = mx.concatenate([embeds[:at], features, embeds[at + features.shape[0]:]])[None]
    positions, delta = mrope_positions(tokens, [grid], vision.spec)
    return tokens, embeds, mx.array(positions.astype(np.int32)), delta


def test_prefill_with_an_image_matches_transformers(golden, lm):
    """The tower's features at the image tokens, multimodal positions in the attention and the
    indexer (its blocks rotated at their first tokens' positions): transformers' logits. With
    the image tokens at text positions instead, the logits move far past the tolerance."""
    from mtp_serve.models.rope_positions import RopePositions

    tokens, embeds, positions, _ = _image_inputs(golden, lm)
    spec = lm.model.vision.spec
    _, logits = lm.model.forward(mx.array([tokens]), lm.model.make_cache(), embeds=embeds,
                                 rope=RopePositions(grid=positions, spec=spec))
    np.testing.assert_allclose(np.array(logits[0]), golden["img_prefill"], atol=ATOL, rtol=0)
    _, at_text = lm.model.forward(mx.array([tokens]), lm.model.make_cache(), embeds=embeds)
    assert np.abs(np.array(at_text[0]) - golden["img_prefill"]).max() > 100 * ATOL


def test_chunks_after_an_image_match_transformers_with_its_cache(golden, lm):
    """The first chunk holds the image (explicit positions); the later ones sit at index + the
    image's shift, and the indexer scores blocks rotated at the positions its cache kept."""
    from mtp_serve.models.rope_positions import RopePositions

    tokens, embeds, positions, delta = _image_inputs(golden, lm)
    spec = lm.model.vision.spec
    assert delta < 0  # an image of 6 tokens spans 3 positions
    cache, out, start = lm.model.make_cache(), [], 0
    for i, n in enumerate(golden["img_chunks"].tolist()):
        kw = dict(embeds=embeds[:, :n], rope=RopePositions(grid=positions[:, :n], spec=spec)) if i == 0 \
            else dict(rope=RopePositions(delta=delta))
        out.append(np.array(lm.model.forward(mx.array([tokens[start : start + n]]), cache, **kw)[1][0]))
        start += n
    np.testing.assert_allclose(np.concatenate(out), golden["img_steps"], atol=ATOL, rtol=0)
    attn = next(c for c in cache if isinstance(c, qwen4_exp.IndexKeys))
    assert mx.array_equal(attn.index_positions[0, :, : len(tokens)], positions + mx.zeros((), mx.int32))


def test_the_synthetic_family_writes_every_part(tmp_path):
    path = write_synthetic_checkpoint(tmp_path / "c", "qwen4_exp")
    config = json.loads((path / "config.json").read_text())
    text = config["text_config"]
    assert config["model_type"] == "qwen4_exp" and text["ple_layer_ids"] and text["indexer_n_heads"]
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(".ngram_embedding.shard_3." in k for k in index)
    assert any(".self_attn.indexer.index_qk_proj." in k for k in index)
    assert any(k.startswith("mtp.") for k in index) and index["mtp.fc.weight"] == "mtp.safetensors"
    assert "hyper_connection_mixer" in " ".join(index)


def ask(server, content: str, depth: int) -> str:
    """A greedy chat reply from the server at MTP depth `depth`."""
    import httpx

    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 24, "temperature": 0, "mtp_depth": depth}
    r = httpx.post(server.base_url + "/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


@pytest.mark.e2e
def test_mtp_serve_serves_the_raw_hf_checkpoint_with_its_head(checkpoint_dir, tmp_path):
    """`mtp-serve --model DIR --enable-mtp` on the raw HF layout: the start-up line reports MTP
    and the n-gram tables, the prompt cache opens its disk tier, and greedy replies with MTP
    equal those without it, also while requests run together in a batch."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from mtp_serve.testing.server_process import ServerProcess

    path = checkpoint_dir("qwen4_exp", agreeable=True)
    with ServerProcess(["--model", path, "--enable-mtp", "--mtp-depth", "2", "--max-batch-size", "4",
                        "--prompt-cache-bytes", "64M", "--prompt-cache-dir", tmp_path / "pc"]) as server:
        replies = {depth: ask(server, "hello there", depth) for depth in (0, 2, 3)}
        questions = ["hello there", "what is 2+2?", "write a haiku about rain"]
        alone = [ask(server, q, 0) for q in questions]
        with ThreadPoolExecutor(len(questions)) as pool:  # together: batched rounds
            together = list(pool.map(lambda q: ask(server, q, 2), questions))
        stream = httpx.post(server.base_url + "/completions", json={"prompt": "abc", "max_tokens": 8, "stream": True},
                            timeout=120)
        assert stream.status_code == 200 and "data: [DONE]" in stream.text
        log = server.stop()
    assert replies[0] == replies[2] == replies[3] and replies[0]
    assert together == alone
    assert "MTP on, depth 2" in log and "PLE n-gram tables 0.3 MiB" in log
    assert "disk tier" in log and "not supported yet" not in log


@pytest.mark.parametrize("bits", [4, 8])
def test_mtp_convert_keeps_the_head_and_quantized_greedy_mtp_equals_plain(bits, checkpoint_dir, tmp_path):
    """mtp-convert (the family's own converter: mlx-lm has no model for it) writes the body in
    this project's layout, quantized, with the head grafted unquantized; the result loads and
    greedy MTP gives plain decoding's tokens. mtp-graft puts a removed head back."""
    from mtp_serve.cli import convert, graft
    from mtp_serve.engine.generator import generate
    from mtp_serve.engine.sampling import SamplingParams

    src = checkpoint_dir("qwen4_exp", agreeable=True)
    out = tmp_path / "conv"
    assert convert.main(["--hf-path", str(src), "--mlx-path", str(out), "-q", "--q-bits", str(bits),
                         "--q-group-size", "32", "--no-verify"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(k.endswith(".scales") and not k.startswith("mtp.") for k in index)
    assert any(k.startswith("mtp.") for k in index) and not any(k.startswith("mtp.") and k.endswith(".scales") for k in index)
    lm = load_model(str(out))
    assert lm.mtp_status == "MTP on" and json.loads((out / "config.json").read_text())["quantization"]["bits"] == bits

    def greedy(prompt, depth):
        return [t for c in generate(lm.model, lm.tokenizer, prompt, SamplingParams(max_tokens=32, ignore_eos=True),
                                    depth=depth) for t in c.token_ids]

    for prompt in ([5, 17, 99, 3, 42, 7, 250, 11], list(range(30, 100, 3))):
        plain = greedy(prompt, 0)
        assert greedy(prompt, 1) == plain and greedy(prompt, 3) == plain

    # mtp-graft: the head removed (as stock converters drop it) and grafted back
    (out / "mtp.safetensors").unlink()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not k.startswith("mtp.")}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    assert load_model(str(out)).mtp_status.startswith("MTP off")
    assert graft.main(["--from", str(src), "--into", str(out), "--no-verify"]) == 0
    assert load_model(str(out)).mtp_status == "MTP on"


def test_the_vision_tower_loads_with_the_backbone(lm):
    """The raw HF checkpoint's tower (`model.visual.*`, Qwen3.5's) is built beside the backbone."""
    from mtp_serve.models.vision import Vision

    assert isinstance(lm.model.vision, Vision) and lm.mtp_status == "MTP on"
    assert lm.model.vision.spec.image_token_id == json.loads((CKPT / "config.json").read_text())["image_token_id"]


def test_a_batch_runs_the_backbone_once_and_equals_its_rows_alone(lm):
    """Three rows of different lengths merged as the engine's batch does: one pass through each
    GatedDeltaNet layer for all rows (their states and PLE windows stacked), attention on each
    row's own indexed cache; a captured verify window committed at a different length per row.
    Logits and the states after the commit equal each row run alone."""
    from mtp_serve.models.qwen4_exp_mtp import BatchGDNCache, RowsKVCache, merge_rows

    model = lm.model
    prompts = [[5, 17, 257, 3, 42, 7, 9], list(range(20, 41)), [250, 11, 12]]
    rows = [model.make_cache() for _ in prompts]
    for p, c in zip(prompts, rows):
        model.forward(mx.array([p]), c)
    alone = [model.make_cache() for _ in prompts]
    for p, c in zip(prompts, alone):
        model.forward(mx.array([p]), c)
    batch = merge_rows([list(layer) for layer in zip(*rows)])
    assert all(isinstance(c, RowsKVCache if not l.is_linear else BatchGDNCache) for c, l in zip(batch, model.layers))
    calls = []
    gdn = next(l.linear_attn for l in model.layers if l.is_linear)
    original = type(gdn).__call__
    type(gdn).__call__ = lambda self, *a, **k: calls.append(a[0].shape[0]) or original(self, *a, **k)
    window = mx.array([[12, 13, 14, 15], [60, 61, 62, 63], [7, 7, 8, 9]])
    kept = [1, 4, 2]
    try:
        set_capture(batch, True)
        _, logits = model.forward(window, batch)
        set_capture(batch, False)
    finally:
        type(gdn).__call__ = original
    assert calls and all(b == 3 for b in calls)  # every GatedDeltaNet layer once, over the 3 rows
    keep_verified(batch, kept, window.shape[1])
    for i, c in enumerate(alone):
        single = model.forward(window[i : i + 1], c)[1]
        assert mx.allclose(logits[i : i + 1], single, atol=1e-5), i
    # after the commit: the next token's logits of each row, batched and alone
    nxt = mx.array([[99], [98], [97]])
    _, after = model.forward(nxt, batch)
    for i, p in enumerate(prompts):
        ref = model.make_cache()
        model.forward(mx.array([p + window[i, : kept[i]].tolist()]), ref)
        assert mx.allclose(after[i : i + 1], model.forward(nxt[i : i + 1], ref)[1], atol=1e-5), i


# ---------------------------------------------------------------- the mlx-community layout


def test_the_mlx_community_layout_loads_to_the_raw_hf_logits(tmp_path, golden, lm):
    """A full-precision checkpoint in mlx-lm main's layout (`model.*`, zero-centred norms, stacked
    experts, conv1d [C, K, 1], no head or tower) loads with its n-gram tables memory-mapped and
    gives the raw HF checkpoint's logits exactly, prefill and step by step."""
    from mtp_serve.testing.mlx_community import write_mlx_community

    path = write_mlx_community(CKPT, tmp_path / "fp")
    names = load_weights(path)
    assert "model.layers.0.ple.conv1d.weight" in names and not any(k.startswith(("mtp.", "model.language_model.")) for k in names)
    mc = load_model(str(path), dtype="float32")
    assert mc.mtp_status.startswith("MTP off") and mc.model.vision is None
    assert qwen4_exp.tables_mapped(mc.model.model.language_model.model)
    tokens = mx.array(golden["a_tokens"])[None]
    np.testing.assert_array_equal(np.array(mc.model.model(tokens)), np.array(lm.model.model(tokens)))
    steps = []
    for model in (mc.model.model, lm.model.model):
        cache = model.make_cache()
        steps.append(np.concatenate([np.array(model(tokens[:, i : i + 1], cache)[0]) for i in range(tokens.shape[1])]))
    np.testing.assert_array_equal(steps[0], steps[1])
    np.testing.assert_allclose(steps[0], golden["a_steps"], atol=ATOL, rtol=0)


def test_a_4bit_mlx_community_body_with_a_grafted_head_gives_plain_greedy(checkpoint_dir, tmp_path):
    """A 4-bit mlx-community conversion (mlx affine, the MoE router left in full precision) loads
    quantized as stored; `mtp-graft` adds the head from the HF checkpoint, and greedy MTP then
    gives plain decoding's tokens."""
    import mlx.nn as nn

    from mtp_serve.cli import graft
    from mtp_serve.engine.generator import generate
    from mtp_serve.engine.sampling import SamplingParams
    from mtp_serve.models.mlx_lm_compat import QuantizedSwitchLinear
    from mtp_serve.testing.mlx_community import write_mlx_community

    src = checkpoint_dir("qwen4_exp", agreeable=True)
    out = write_mlx_community(src, tmp_path / "q4", bits=4)
    names = load_weights(out)
    assert "model.layers.0.mlp.switch_mlp.gate_proj.scales" in names and "model.layers.0.mlp.gate.scales" not in names
    layer = load_model(str(out)).model.model.layers[0]
    assert isinstance(layer.mlp.switch_mlp.gate_proj, QuantizedSwitchLinear)
    assert isinstance(layer.attn_hyper_connection.input_mix_weight_down, nn.QuantizedLinear)
    assert type(layer.mlp.gate) is nn.Linear
    assert graft.main(["--from", str(src), "--into", str(out), "--no-verify"]) == 0
    lm = load_model(str(out))
    assert lm.mtp_status == "MTP on"

    def greedy(prompt, depth):
        return [t for c in generate(lm.model, lm.tokenizer, prompt, SamplingParams(max_tokens=32, ignore_eos=True),
                                    depth=depth) for t in c.token_ids]

    for prompt in ([5, 17, 99, 3, 42, 7, 250, 11], list(range(30, 100, 3))):
        plain = greedy(prompt, 0)
        assert greedy(prompt, 1) == plain and greedy(prompt, 3) == plain


def test_an_mlx_community_quantized_ngram_table_or_non_affine_body_refuses_by_name(tmp_path):
    from mtp_serve.testing.mlx_community import write_mlx_community

    path = write_mlx_community(CKPT, tmp_path / "fp")
    weights = load_weights(path)
    weights["model.layers.0.ple.ple_embedding.ngram_embedding.shard_0.scales"] = mx.zeros((1024, 1))
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    with pytest.raises(CheckpointError, match="qwen4_exp: a quantized PLE n-gram table .*is not supported yet"):
        load_model(str(path))
    config = json.loads((path / "config.json").read_text())
    config["quantization"] = {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="qwen4_exp: 'mxfp4' quantization .*is not supported yet"):
        load_model(str(path))


@pytest.mark.e2e
def test_mtp_serve_serves_a_grafted_4bit_mlx_community_conversion(checkpoint_dir, tmp_path):
    """`mtp-serve --model DIR --enable-mtp` on a 4-bit mlx-community conversion with the head
    grafted: MTP on, and greedy replies with MTP equal those without it."""
    from mtp_serve.cli import graft
    from mtp_serve.testing.mlx_community import write_mlx_community
    from mtp_serve.testing.server_process import ServerProcess

    src = checkpoint_dir("qwen4_exp", agreeable=True)
    path = write_mlx_community(src, tmp_path / "q4", bits=4)
    assert graft.main(["--from", str(src), "--into", str(path), "--no-verify"]) == 0
    with ServerProcess(["--model", path, "--enable-mtp", "--mtp-depth", "2"]) as server:
        replies = {depth: ask(server, "hello there", depth) for depth in (0, 2, 3)}
        log = server.stop()
    assert replies[0] == replies[2] == replies[3] and replies[0]
    assert "MTP on, depth 2" in log and "not supported yet" not in log
