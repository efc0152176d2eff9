"""End to end: opencode, Claude Code and Codex CLI, configured exactly as README.md says, complete
two turns each against the server, offline; the second turn reuses the first's prompt from the
prompt cache. The configurations are read from the README's `<!-- agent-config: NAME -->`
blocks, so the README and the tests cannot drift apart: no output-limit variables, no `limit`
block, each CLI's own default output budget (opencode and Claude Code send max_tokens 32,000,
which the server lowers to what the context leaves; Codex sends none).

Contexts: the demo model's default (32,768) and `--max-context 16384`. opencode runs on the
demo model itself, as the README's `mtp-serve --enable-mtp` serves it. The demo model answers an
agent's prompt with a whole Python module, 1-5k tokens a turn at 10-20k tokens of context
(minutes a turn on 2 cores), so there opencode's budget is its own variable
`OPENCODE_EXPERIMENTAL_OUTPUT_TOKEN_MAX` (the README's opencode.json unchanged). Every agent also
runs on a small synthetic model whose few likely tokens include EOS (opencode also on the same
model as a vision-language checkpoint, the form real Qwen3.5/3.6 checkpoints ship in), with each
CLI's default budget: its replies end after a handful of tokens, so a turn costs little more than
its prefill. Its tokenizer makes the agents'
prompts about 12k (opencode), 13-17k (Claude Code) and 20k (Codex) tokens: a prompt that does
not fit 16,384 is the agent's own limit, and there the test checks the user is told so.
Each agent's two turns run once on the synthetic text model, each at a context its prompt fits:
opencode and Claude Code at 16,384 (the tighter budget to lower; the same server path as at
32,768, where opencode runs on the demo model and the vision-language checkpoint, and Claude
Code beside a second model in test_multi_model.py), Codex at 32,768.
The agents come from npm (`./install.sh --test`); tests/support/npm_clients.py finds them.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Optional

import httpx
import pytest

from support.npm_clients import REPO, failed_requests, metric, npm_bin
from support.server import serve

pytestmark = pytest.mark.agents

README_URL = "http://127.0.0.1:8000"
DEMO_CONTEXT = 32768


def readme_block(name: str) -> str:
    """The fenced block after `<!-- agent-config: NAME -->` in README.md."""
    text = (REPO / "README.md").read_text()
    m = re.search(r"<!-- agent-config: %s -->\s*```\w*\n(.*?)```" % re.escape(name), text, re.S)
    assert m, f"README.md has no agent-config block '{name}'"
    return m.group(1)


def exported_env(block: str) -> dict:
    """The variables a bash block `export`s (comments dropped)."""
    env = {}
    for line in block.splitlines():
        words = shlex.split(line, comments=True)
        if words[:1] == ["export"]:
            env.update(w.split("=", 1) for w in words[1:])
    return env


def clean_env(home: Path, *prefixes: str) -> dict:
    """This environment without the agents' own settings; HOME a scratch folder."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes + ("XDG_",))}
    home.mkdir(parents=True, exist_ok=True)
    env["HOME"] = str(home)
    return env


class Agent:
    """One agent CLI set up from the README in a scratch project folder."""

    endpoint = ""
    sends_budget = True  # sends max_tokens 32,000 for a model it does not know
    output_cap = None  # its max_tokens where the test set one (Opencode.cap_output)

    def __init__(self, server, tmp: Path):
        self.server, self.project = server, tmp / "project"
        self.project.mkdir(parents=True)
        self.env = self.setup(tmp)

    def setup(self, tmp: Path) -> dict:
        raise NotImplementedError

    def command(self, prompt: str, first: bool) -> list:
        raise NotImplementedError

    def turn(self, prompt: str, first: bool) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(prompt, first), cwd=self.project, env=self.env, stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=420)


class Opencode(Agent):
    endpoint = "/v1/chat/completions"
    title = None  # `--title`: the session named, opencode asks the model for no title

    def setup(self, tmp):
        config = readme_block("opencode").replace(README_URL, self.server.root)
        json.loads(config)
        (self.project / "opencode.json").write_text(config)
        env = clean_env(tmp / "home", "OPENCODE")
        env["PWD"] = str(self.project)  # opencode takes its project folder from $PWD
        self.bin = npm_bin("opencode", "opencode", "OPENCODE_BIN")
        return env

    def cap_output(self, tokens: int) -> None:
        """opencode's own output budget (its max_tokens) instead of its default 32,000."""
        self.env["OPENCODE_EXPERIMENTAL_OUTPUT_TOKEN_MAX"] = str(tokens)
        self.sends_budget, self.output_cap = False, tokens

    def command(self, prompt, first):
        named = ["--title", self.title] if self.title and first else []
        return [self.bin, "run", *([] if first else ["-c"]), *named, "-m", "mtp-serve/demo", prompt]


class ClaudeCode(Agent):
    endpoint = "/v1/messages"

    def setup(self, tmp):
        env = clean_env(tmp / "home", "ANTHROPIC_", "CLAUDE")
        exports = exported_env(readme_block("claude"))
        assert not any("MAX_OUTPUT" in k or "MAX_CONTEXT" in k for k in exports), exports  # no budget variables
        env.update({k: v.replace(README_URL, self.server.root) for k, v in exports.items()})
        self.bin = npm_bin("claude", "claude", "CLAUDE_BIN")
        return env

    def command(self, prompt, first):
        return [self.bin, "-p", *([] if first else ["--continue"]), prompt]


class Codex(Agent):
    endpoint = "/v1/responses"
    sends_budget = False

    def setup(self, tmp):
        home = tmp / "codex"
        home.mkdir()
        (home / "config.toml").write_text(readme_block("codex").replace(README_URL, self.server.root))
        env = clean_env(tmp / "home", "CODEX_", "OPENAI_")
        env["CODEX_HOME"] = str(home)
        self.bin = npm_bin("codex", "codex", "CODEX_BIN")
        return env

    def command(self, prompt, first):
        resume = [] if first else ["resume", "--last"]
        return [self.bin, "exec", *resume, "--skip-git-repo-check", prompt]


AGENTS = {"opencode": Opencode, "claude": ClaudeCode, "codex": Codex}


def metrics(server) -> str:
    return httpx.get(server.root + "/metrics").text


def served_ok(text: str, endpoint: str) -> float:
    return metric(text, r'mtp_requests_total\{endpoint="%s",status="200"\}' % re.escape(endpoint))


def delta(after: str, before: str, name: str) -> float:
    return metric(after, name) - metric(before, name)


def two_turns(agent: Agent) -> None:
    server, endpoint = agent.server, agent.endpoint
    before = metrics(server)
    r1 = agent.turn("Say hello", first=True)
    after1 = metrics(server)
    if r1.returncode == 0 and served_ok(after1, endpoint) == served_ok(before, endpoint):
        # Once in a full CI-like run Codex closed its only stream itself (499, the server's side
        # fine) and still exited 0; the synthetic model's sampled reply differs every run. One
        # more try tells that apart from a server that never answers.
        r1 = agent.turn("Say hello", first=True)
        after1 = metrics(server)
    assert r1.returncode == 0, r1.stdout[-2000:] + r1.stderr[-2000:]
    assert served_ok(after1, endpoint) - served_ok(before, endpoint) >= 1, (after1, r1.stdout[-3000:], r1.stderr[-3000:])
    assert failed_requests(after1, endpoint) == 0, after1
    prompt1 = delta(after1, before, "mtp_prompt_tokens_total")
    assert prompt1 > 5000, prompt1  # the agent's system prompt and tool schemas
    if agent.sends_budget:  # its 32,000-token budget did not fit beside the prompt: lowered, not refused
        assert delta(after1, before, "mtp_max_tokens_lowered_total") >= 1, after1

    r2 = agent.turn("And again", first=False)
    after2 = metrics(server)
    assert r2.returncode == 0, r2.stdout[-2000:] + r2.stderr[-2000:]
    assert failed_requests(after2, endpoint) == 0, after2
    # Turn 2 resends turn 1's conversation: most of its prompt comes from the prompt cache
    # (all but the new message and what follows the last snapshot).
    prompt2 = delta(after2, after1, "mtp_prompt_tokens_total")
    cached2 = delta(after2, after1, "mtp_cached_prompt_tokens_total")
    # A turn may hold several requests (a tool call and its follow-up); their new parts are not
    # cached, so the reuse is measured against the conversation turn 1 left behind.
    assert prompt2 > 5000 and cached2 > 0.8 * min(prompt2, prompt1), (cached2, prompt2, prompt1)
    assert server.service.engine.active_count == 0
    if agent.output_cap:  # every request kept to the budget the agent was given
        requests = served_ok(after2, endpoint) - served_ok(before, endpoint)
        assert delta(after2, before, "mtp_completion_tokens_total") <= agent.output_cap * requests, after2


def context_refused(agent: Agent) -> None:
    """A prompt longer than the served context: the server answers 400 context_length_exceeded
    (never a cut prompt), and the agent fails saying it is out of context."""
    before = metrics(agent.server)
    r = agent.turn("Say hello", first=True)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "context" in out.lower(), out[-2000:]
    refused = r'mtp_requests_total\{endpoint="%s",status="400"\}' % re.escape(agent.endpoint)
    assert delta(metrics(agent.server), before, refused) >= 1


# The synthetic model with real Qwen3.5's layer mix, three GatedDeltaNet layers to one attention
# layer: the agents' prompts are prefills of 12-20k tokens, and attention is most of their cost.
AGENT_MODEL = dict(agreeable=True, likely_eos=True, full_attention_interval=4)


@pytest.fixture(scope="module")
def synthetic_server(request, checkpoint_dir):
    """The synthetic model at the context the test names (indirect parameter)."""
    s = serve(checkpoint_dir("qwen3_5", **AGENT_MODEL), served_model_name="demo", mtp_depth=2,
              max_context=request.param)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def vision_language_server(checkpoint_dir):
    """The synthetic model as a vision-language checkpoint (Qwen3_5ForConditionalGeneration with a
    vision tower), the form real Qwen3.5/3.6 checkpoints ship in."""
    s = serve(checkpoint_dir("qwen3_5", vision=True, **AGENT_MODEL), served_model_name="demo",
              mtp_depth=2, max_context=DEMO_CONTEXT)
    assert s.service.loaded.model.vision is not None
    yield s
    s.stop()


@pytest.fixture(scope="module")
def demo_server():
    from mtp_serve.models.demo_model import default_model_path

    s = serve(default_model_path(), served_model_name="demo", mtp_depth=2)
    yield s
    s.stop()


# Agents whose own prompt (system prompt and tool schemas) is over 16,384 tokens with the
# synthetic model's tokenizer: at --max-context 16384 nothing can serve them.
PROMPT_OVER_16K = ("codex",)


def run_agent(name: str, server, tmp_path, title: Optional[str] = None, output_cap: Optional[int] = None) -> None:
    agent = AGENTS[name](server, tmp_path)
    if title:
        agent.title = title
    if output_cap:
        agent.cap_output(output_cap)
    try:
        if server.service.max_context < DEMO_CONTEXT and name in PROMPT_OVER_16K:
            context_refused(agent)
        else:
            two_turns(agent)
    finally:
        shutil.rmtree(tmp_path / "home", ignore_errors=True)


# (context, agent): the prompt of each fits its context but Codex's at 16,384, refused there.
SYNTHETIC_RUNS = [(16384, "opencode"), (16384, "claude"), (16384, "codex"), (DEMO_CONTEXT, "codex")]


@pytest.mark.parametrize("synthetic_server,name", SYNTHETIC_RUNS, indirect=["synthetic_server"],
                         ids=[f"ctx{c // 1024}k-{n}" for c, n in SYNTHETIC_RUNS])
def test_agent_two_turns_synthetic(name, synthetic_server, tmp_path):
    run_agent(name, synthetic_server, tmp_path)


def test_opencode_two_turns_vision_language(vision_language_server, tmp_path):
    """The second turn reuses the first's prefix on a vision-language checkpoint too (one agent: the
    three share every server path the checkpoint's kind could change, and each costs minutes)."""
    run_agent("opencode", vision_language_server, tmp_path)


# opencode's budget on the demo model: enough for a reply to run for many MTP rounds; a whole
# module (the demo model's answer to any request) would take minutes a turn.
DEMO_OUTPUT_CAP = 256


def test_opencode_two_turns_demo_model(demo_server, tmp_path):
    """With a title given (`opencode run --title`), so opencode sends no title request: the demo model answers
    that 841-token request with thousands of tokens beside the first turn. The synthetic tests
    above send it (and cancel it). opencode's output budget is its own variable (DEMO_OUTPUT_CAP):
    the 32,000 it sends by default, lowered by the server, runs the synthetic tests above."""
    run_agent("opencode", demo_server, tmp_path, title="Say hello", output_cap=DEMO_OUTPUT_CAP)
