"""MTP is lossless under an eval harness: lm-evaluation-harness against the server, MTP on and off.

Runs lm-evaluation-harness's `local-completions` model (what users point at an OpenAI-compatible
server) on two small task files shipped in bench/data/eval_tasks/ (no hub downloads):
- `heldout_code_mc`, loglikelihood: which of four lines comes next in held-out Python code
  (the three others are lines from elsewhere in the same file). lm-eval sends each choice with
  `echo: true, logprobs: 1, max_tokens: 1` and reads the prompt tokens' log-probabilities.
- `heldout_code_line`, greedy generation: complete a line of held-out code from its first words
  (`until: "\\n"`), exact match against the rest of the real line.
It serves the demo model once (`mtp-serve --enable-mtp --mtp-depth 3 --fixed-depth`) and runs both
tasks twice against it: with MTP, and with every request's `mtp_depth: 0` (a field lm-eval passes
through from the task's generation_kwargs), then prints the table: scores side by side, and how
many per-sample outputs (loglikelihoods, generations) are identical. MTP must change nothing.
One server for both: two server processes may each calibrate decode matmuls differently at
start-up (OpenBLAS threads, the skinny sgemm), which can move the last bits of a logit.

    pip install "lm_eval[api]"     # not a test dependency: the benchmark's only
    python bench/eval_lossless.py
    python bench/eval_lossless.py --make-tasks   # rebuild the task files from the held-out sources
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mtp_serve.testing.server_process import ServerProcess  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TASKS = REPO / "bench" / "data" / "eval_tasks"
DEMO = REPO / "models" / "demo"


def make_tasks(n_mc: int = 60, n_gen: int = 40, seed: int = 0) -> None:
    """Task files from the files held out of the demo model's training (Python's standard library)."""
    src = Path(os.__file__).parent
    rng = random.Random(seed)
    files = [src / f for f in json.loads((DEMO / "heldout_files.json").read_text()) if (src / f).exists()]
    mc, gen = [], []
    for path in files:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        code = [i for i, line in enumerate(lines) if len(line.strip()) > 12 and i > 8]
        if len(code) < 8:
            continue
        for i in rng.sample(code, min(8, len(code))):
            context = "\n".join(lines[max(0, i - 12):i]) + "\n"
            others = [lines[j] for j in rng.sample(code, 8) if lines[j] != lines[i]][:3]
            if len(others) == 3 and len(mc) < n_mc and (len(gen) >= n_gen or rng.random() < 0.6):
                choices = others + [lines[i]]
                rng.shuffle(choices)
                mc.append({"context": context, "choices": choices, "answer": choices.index(lines[i])})
            elif len(gen) < n_gen:
                # the line's first words are given and the rest completed; the split is at a space, so
                # the target starts with " word" as the tokenizer splits it inside a line
                line = lines[i]
                spaces = [k for k, ch in enumerate(line) if ch == " " and k > len(line) - len(line.lstrip()) + 2]
                if spaces:
                    k = spaces[len(spaces) // 3]
                    gen.append({"context": context + line[:k], "target": line[k:]})
    TASKS.mkdir(parents=True, exist_ok=True)
    for name, rows in (("heldout_code_mc", mc), ("heldout_code_line", gen)):
        with open(TASKS / f"{name}.jsonl", "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    print(f"wrote {len(mc)} multiple-choice and {len(gen)} generation items to {TASKS}")


TASK_YAML = {
    "heldout_code_mc": """task: heldout_code_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
""",
    "heldout_code_line": """task: heldout_code_line
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{target}}}}"
target_delimiter: ""
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 48
  temperature: 0
{extra}metric_list:
  - metric: exact_match
""",
}


def run_lm_eval(base_url: str, out: Path, tasks_dir: Path) -> dict:
    """One lm-eval run over both tasks; per task: (score, per-sample outputs)."""
    cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions",
           "--model_args", f"model=demo,base_url={base_url}/completions,tokenizer_backend=huggingface,tokenizer={DEMO},"
                           "tokenized_requests=True,num_concurrent=1,max_retries=1",
           "--tasks", ",".join(TASK_YAML), "--include_path", str(tasks_dir), "--output_path", str(out), "--log_samples"]
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    results = {}
    summary = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
    for task in TASK_YAML:
        samples = [json.loads(line) for f in out.rglob(f"samples_{task}_*.jsonl") for line in f.read_text().splitlines()]
        samples.sort(key=lambda s: s["doc_id"])
        metric = "acc,none" if task.endswith("_mc") else "exact_match,none"
        results[task] = (summary[task][metric], [s["resps"] for s in samples])
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--make-tasks", action="store_true", help="rebuild bench/data/eval_tasks from the held-out sources")
    p.add_argument("--depth", type=int, default=3, help="--mtp-depth of the MTP server")
    args = p.parse_args()
    if args.make_tasks:
        make_tasks()
        return
    with tempfile.TemporaryDirectory() as tmp:
        flags = ["--enable-mtp", "--mtp-depth", str(args.depth), "--fixed-depth"]
        runs = {}
        with ServerProcess(flags, start_timeout=900) as server:
            for label, extra in (("MTP off (mtp_depth 0)", "  mtp_depth: 0\n"), (f"MTP on (depth {args.depth})", "")):
                tasks_dir = Path(tmp) / f"tasks{len(runs)}"
                tasks_dir.mkdir()
                for task, text in TASK_YAML.items():
                    (tasks_dir / f"{task}.yaml").write_text(text.format(data=TASKS / f"{task}.jsonl", extra=extra))
                runs[label] = run_lm_eval(server.base_url, Path(tmp) / f"out{len(runs)}", tasks_dir)
    off, on = runs.values()
    print(f"\n| task | samples | {' | '.join(runs)} | identical per-sample outputs |")
    print("|---|---|---|---|---|")
    for task in TASK_YAML:
        (s_off, r_off), (s_on, r_on) = off[task], on[task]
        same = sum(a == b for a, b in zip(r_off, r_on))
        print(f"| {task} | {len(r_off)} | {s_off:.4f} | {s_on:.4f} | {same}/{len(r_off)} |")


if __name__ == "__main__":
    main()
