"""Every GPU check in one run, written as one markdown report (the CPU runs it too).

    python bench/gpu_report.py [--out gpu-report.md] [--quick] [--budget-s 540] [--sections ...]

Sections, each in its own process with its own time limit (a crash or a hang costs that
section, not the report), the report rewritten after each so a run cut short keeps what
it measured:

* `env`: the device, MLX and mlx-lm versions, the card (`nvidia-smi`), the backend note;
* `identity`: the identity fixtures (random-weight synthetic checkpoints whose head agrees
  with the backbone: dense `qwen3_5`, MoE `qwen3_5_moe`, `qwen3_next`; fp32, bf16, 8- and
  4-bit bodies): greedy MTP at depths 1-3 against plain greedy, token for token, one row
  and a batch of two, and pipelined plain against unpipelined plain;
* `invariance`: `bench/row_invariance.py` for M = 2-16 rows (M = 1 is the row alone):
  which window operation gives a row its single-step bits;
* `pipeline`: `bench/bench_pipeline.py` on the demo model: pipelined plain decoding against
  the unpipelined loop and mlx-lm, one row, a batch of 4, MTP depth 3;
* `windows`: `bench/bench_windows.py`: verify windows T = 1-8 in plain steps at 0.8B and 4B
  shapes, fp32 / 8-bit / 4-bit bodies;
* `quantized`: `bench/bench_quantized.py`'s rows (0.8B, 2B, 4B, A3B layout; 4 and 8 bits):
  plain against mlx-lm, verify T=2..5, MTP at oracle acceptance 0.8 depths 1-4 against own
  plain, and whether MTP's tokens were plain's.

`--quick` runs every section at toy sizes (minutes on a CPU): to check the script before
device time is spent on it. Nothing here asserts: the report says what it measured.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
SECTIONS = ["env", "identity", "quantized", "invariance", "windows", "pipeline"]  # the targets' checks first

# (arguments, seconds allowed) per section: the full run on a GPU, and --quick.
FULL = {
    "identity": (["--families", "qwen3_5", "qwen3_5_moe", "qwen3_next", "--bodies", "fp32", "bf16", "8", "4",
                  "--depths", "1", "2", "3", "--tokens", "48"], 90),
    "invariance": (["--rows", *map(str, range(2, 17)), "--dtypes", "float32", "bfloat16"], 40),
    "pipeline": (["--max-tokens", "96", "--prompts", "4", "--rows", "4", "--depth", "3"], 45),
    "windows": (["--shapes", "0.8b", "4b", "--bodies", "fp32", "8", "4", "--windows", *map(str, range(1, 9)),
                 "--reps", "5"], 60),
    "quantized": (["--rows", "0.8b:4", "2b:4", "4b:4", "a3b:4", "0.8b:8", "2b:8", "4b:8", "a3b:8", "--tokens", "48",
                   "--mlx-lm-tokens", "48", "--depths", "1", "2", "3", "4", "--acceptance", "0.8"], 200),
}
QUICK = {
    "identity": (["--families", "qwen3_5", "--bodies", "fp32", "4", "--depths", "2", "--tokens", "12"], 240),
    "invariance": (["--rows", "2", "4", "--dtypes", "float32"], 300),
    "pipeline": (["--max-tokens", "12", "--prompts", "2", "--rows", "2", "--depth", "2", "--prompt-tokens", "32"], 240),
    "windows": (["--shapes", "0.8b", "--bodies", "4", "--windows", "1", "2", "--reps", "1"], 300),
    "quantized": (["--rows", "0.8b:4", "--tokens", "4", "--mlx-lm-tokens", "2", "--depths", "1",
                   "--acceptance", "0.8"], 420),
}
SCRIPTS = {"invariance": "row_invariance.py", "pipeline": "bench_pipeline.py", "windows": "bench_windows.py",
           "quantized": "bench_quantized.py"}
TARGETS = """Targets (issue: MTP on the GPU): plain >= 1.0x mlx-lm on every `quantized` row; a T=4 window
<= 1.3 plain steps at 4B 4-bit (`windows`, `quantized`); MTP depth 3 >= 1.5x own plain at 4B 4-bit
(`quantized`, oracle acceptance 0.8); MTP's tokens = plain's on every row (`identity`, `quantized`)."""


def environment() -> str:
    """The device and versions, from a child (importing MLX here would hold the GPU)."""
    code = ("import mtp_serve, mlx.core as mx, importlib.metadata as md;"
            "print('device:', mx.default_device());"
            "print('mlx', md.version('mlx'), '/ mlx-lm', md.version('mlx-lm'));"
            "cuda = getattr(mx, 'cuda', None); print('cuda available:', bool(cuda and cuda.is_available()));"
            "print('metal available:', mx.metal.is_available());"
            "print('backend:', mtp_serve.BACKEND.note)")
    out = [f"python {platform.python_version()}, {platform.platform()}, {os.cpu_count()} CPUs"]
    out.append(_run([sys.executable, "-c", code], 120)[1].strip())
    if shutil.which("nvidia-smi"):
        out.append(_run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"], 30)[1]
                   .strip())
    else:
        out.append("nvidia-smi: not found (no NVIDIA GPU here)")
    return "\n".join(out)


def _run(cmd: List[str], limit: float) -> tuple:
    """(exit status or 'timeout', stdout and stderr)."""
    try:
        p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=limit,
                           env=dict(os.environ, MTP_PROGRESS="0", PYTHONUNBUFFERED="1"))
        return p.returncode, p.stdout + (("\n[stderr]\n" + p.stderr[-4000:]) if p.returncode and p.stderr else "")
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return "timeout", out + f"\n[stopped after {limit:.0f} s]"


# ------------------------------------------------------------------ identity (a child process)


def identity(args) -> None:
    """Greedy MTP against plain greedy, and pipelined against unpipelined plain, per fixture."""
    import mtp_serve  # noqa: F401  (before mlx.core)
    import mlx.core as mx

    from mtp_serve.engine.generator import generate
    from mtp_serve.engine.policy import DepthPolicy
    from mtp_serve.engine.sampling import SamplingParams
    from mtp_serve.engine.scheduler import Scheduler
    from mtp_serve.models.loader import load_model
    from mtp_serve.testing.quantized import QUANT_TEXT, quantize_loaded
    from mtp_serve.testing.synthetic import write_synthetic_checkpoint

    prompts = [[5, 17, 99, 3, 42, 7, 250, 11], list(range(30, 130, 3))]
    on_cpu = mx.default_device() == mx.cpu

    def one(lm, prompt, depth, pipeline=True):
        params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
        out, stats = [], None
        for c in generate(lm.model, lm.tokenizer, prompt, params, depth, copy_max=0, pipeline=pipeline):
            out += c.token_ids
            stats = c.stats
        return out, stats

    def batch(lm, depth):
        sched = Scheduler(lm.model, lm.tokenizer, max_batch_size=2, prefill_chunk=None,
                          policy=DepthPolicy(max_depth=depth, fixed=True), copy_max=0)
        for i, p in enumerate(prompts):
            sched.add(i, p, SamplingParams(max_tokens=args.tokens, ignore_eos=True), depth)
        out = {0: [], 1: []}
        while sched.has_work():
            for k, c in sched.step():
                if isinstance(c, BaseException):
                    raise c
                out[k] += c.token_ids
        return [out[0], out[1]]

    print("| fixture | body | pipelined plain = plain | batch of 2 plain = alone | "
          + " | ".join(f"MTP d{d} = plain (alone; batch of 2; accepted/drafted)" for d in args.depths) + " | s |")
    print("|---|---|---|---|" + "---|" * len(args.depths) + "---|")
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families:
            for body in args.bodies:
                t0 = time.perf_counter()
                try:
                    dtype = mx.bfloat16 if body == "bf16" else mx.float32
                    quant = body in ("8", "4")
                    path = write_synthetic_checkpoint(Path(tmp) / f"{family}-{body}", family, agreeable=True,
                                                      dtype=dtype, **(QUANT_TEXT if quant else {}))
                    lm = load_model(str(path))
                    if quant:
                        bits = int(body)
                        quantize_loaded(lm.model, bits, 64 if bits == 4 else 32, kernel=on_cpu)
                    plain = [one(lm, p, 0, pipeline=False)[0] for p in prompts]
                    piped = [one(lm, p, 0)[0] for p in prompts]
                    cells = [_same(piped, plain), _same(batch(lm, 0), plain)]
                    for d in args.depths:
                        runs = [one(lm, p, d) for p in prompts]
                        drafted = sum(sum(s.drafted) for _, s in runs)
                        accepted = sum(sum(s.accepted) for _, s in runs)
                        cells.append(f"{_same([t for t, _ in runs], plain)}; {_same(batch(lm, d), plain)}; "
                                     f"{accepted}/{drafted}")
                    print(f"| {family} | {body} | " + " | ".join(cells) + f" | {time.perf_counter() - t0:.0f} |",
                          flush=True)
                except Exception as e:  # noqa: BLE001 - one fixture's failure is a line of the report
                    print(f"| {family} | {body} | error: {type(e).__name__}: {str(e)[:200]} |", flush=True)


def _same(got: List[List[int]], ref: List[List[int]]) -> str:
    """'yes', or where the first row that differs first differs."""
    for i, (a, b) in enumerate(zip(got, ref)):
        if a != b:
            at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return f"**no** (prompt {i}, token {at})"
    return "yes"


# ------------------------------------------------------------------ the report


def write(path: Path, header: str, parts: Dict[str, str]) -> None:
    path.write_text(header + "\n\n" + "\n\n".join(parts.values()) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="the markdown report (default: $OUT/gpu-report.md, else ./gpu-report.md)")
    ap.add_argument("--quick", action="store_true", help="toy sizes: check the script (on a CPU) before device time")
    ap.add_argument("--sections", nargs="+", default=SECTIONS, choices=SECTIONS)
    ap.add_argument("--budget-s", type=float, default=420.0, help="sections that would start past it are skipped")
    ap.add_argument("--identity", action="store_true", help=argparse.SUPPRESS)  # the identity child
    ap.add_argument("--families", nargs="+", default=["qwen3_5"])
    ap.add_argument("--bodies", nargs="+", default=["fp32"], choices=["fp32", "bf16", "8", "4"])
    ap.add_argument("--depths", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()
    if args.identity:
        identity(args)
        return

    out = Path(args.out or Path(os.environ.get("OUT", ".")) / "gpu-report.md")
    plan = QUICK if args.quick else FULL
    start = time.perf_counter()
    header = (f"# mtp-serve GPU report\n\n`python bench/gpu_report.py {' '.join(sys.argv[1:])}`, started "
              f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}" + (" (--quick: toy sizes)" if args.quick else "")
              + f"\n\n{TARGETS}")
    parts: Dict[str, str] = {}
    for name in args.sections:
        used = time.perf_counter() - start
        if name == "env":
            parts[name] = f"## env\n\n```\n{environment()}\n```"
            write(out, header, parts)
            continue
        extra, limit = plan[name]
        limit = min(limit, args.budget_s - used)
        if limit < 20:
            parts[name] = f"## {name}\n\nskipped: {used:.0f} s of the {args.budget_s:.0f} s budget used"
            write(out, header, parts)
            continue
        script = [str(BENCH / "gpu_report.py"), "--identity"] if name == "identity" else [str(BENCH / SCRIPTS[name])]
        cmd = [sys.executable, *script, *extra]
        t0 = time.perf_counter()
        status, text = _run(cmd, limit)
        shown = " ".join(["python", os.path.relpath(script[0], REPO), *script[1:], *extra])
        parts[name] = (f"## {name}\n\n`{shown}`: exit {status}, {time.perf_counter() - t0:.0f} s "
                       f"(limit {limit:.0f} s)\n\n" + (text if name == "identity" else f"```\n{text.strip()}\n```"))
        write(out, header, parts)
        print(f"{name}: exit {status} in {time.perf_counter() - t0:.0f} s", flush=True)
    print(f"wrote {out} ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
