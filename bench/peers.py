"""The peer runner: MTPLX (PyPI `mtplx`, the strongest MLX peer; not a dependency of
this project: `pip install --no-deps mtplx`) decoding the same checkpoint cast to
fp32, in its own worker process (its load patches mlx-lm classes; a separate
process keeps those patches away from everything else), imported through
`bench/mtplx_shim.py`.

    worker = MtplxWorker(model_path, timeout_s=600, config="server")
    worker.run(prompt_ids, n, depth)   # -> RunResult; depth 0: generate_ar, else generate_mtpk
"""

from __future__ import annotations

import mtp_serve  # noqa: F401  (before mlx.core: OpenBLAS preload, fp32 on CPU)

import multiprocessing as mp
import sys
import traceback
from typing import Any, Dict, List

import mlx.core as mx
from mlx.utils import tree_flatten

from common import BENCH_DIR, RunResult, fp32, one_line, pc

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
