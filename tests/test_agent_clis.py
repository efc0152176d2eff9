"""End to end: Claude Code (Anthropic Messages) and Codex CLI (OpenAI Responses) complete
turns against the server, offline. Both come from npm (`./install.sh --test`); see
tests/npm_clients.py for how they are found.

The model is a small synthetic one whose few likely tokens include EOS, so the agents'
sampled replies end after a handful of tokens (Claude Code fails a turn that hits its
output limit). Their prompts (system prompt and tool schemas) are 12-17k (Claude Code) and
20k (Codex) tokens with the byte tokenizer.
"""

import os
import shutil
import subprocess

import httpx
import pytest

from npm_clients import failed_requests, metric, npm_bin
from test_server_support import serve


@pytest.fixture(scope="module")
def server(checkpoint_dir):
    s = serve(checkpoint_dir("qwen3_5", agreeable=True, likely_eos=True), served_model_name="tiny", mtp_depth=2, max_context=65536)
    yield s
    s.stop()


def clean_env(tmp_path, *prefixes) -> dict:
    """The environment without the agents' own settings, HOME a scratch directory."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env["HOME"] = str(home)
    return env


MESSAGES_OK = r'mtp_requests_total\{endpoint="/v1/messages",status="200"\}'


def metrics(server) -> str:
    return httpx.get(server.root + "/metrics").text


def test_claude_code_two_turns(server, tmp_path):
    claude = npm_bin("claude", "claude", "CLAUDE_BIN")
    project = tmp_path / "project"
    project.mkdir()
    env = clean_env(tmp_path, "ANTHROPIC_", "CLAUDE", "XDG_")
    env.update(ANTHROPIC_BASE_URL=server.root, ANTHROPIC_API_KEY="none", ANTHROPIC_MODEL="tiny",
               ANTHROPIC_SMALL_FAST_MODEL="tiny", ANTHROPIC_DEFAULT_HAIKU_MODEL="tiny",
               CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", CLAUDE_CODE_MAX_OUTPUT_TOKENS="256",
               CLAUDE_CODE_MAX_CONTEXT_TOKENS=str(server.service.max_context))
    try:
        before = metrics(server)
        r1 = subprocess.run([claude, "-p", "Say hello"], cwd=project, env=env, capture_output=True, text=True, timeout=240)
        after1 = metrics(server)
        assert r1.returncode == 0, r1.stdout[-2000:] + r1.stderr[-2000:]
        # Told the served context (README), it does not assume a 1M-token window for "tiny".
        assert "assumes a context window" not in r1.stderr, r1.stderr[-2000:]
        assert metric(after1, MESSAGES_OK) >= 1
        prompt1 = metric(after1, "mtp_prompt_tokens_total") - metric(before, "mtp_prompt_tokens_total")
        assert prompt1 > 5000, after1  # Claude Code's system prompt and tools
        assert failed_requests(after1, "/v1/messages") == 0, after1

        r2 = subprocess.run([claude, "-p", "--continue", "And again"], cwd=project, env=env, capture_output=True, text=True, timeout=240)
        after2 = metrics(server)
        assert r2.returncode == 0, r2.stdout[-2000:] + r2.stderr[-2000:]
        # Turn 2 resends turn 1's conversation: nearly all of its prompt comes from the prompt
        # cache. A turn may take more than one request (CI once saw Claude Code send turn 1's
        # request twice), so this compares turn 2's cached tokens with turn 2's own prompts:
        # without reuse across turns, its first request would be cold and the turn at most
        # about half cached.
        prompt2 = metric(after2, "mtp_prompt_tokens_total") - metric(after1, "mtp_prompt_tokens_total")
        cached2 = metric(after2, "mtp_cached_prompt_tokens_total") - metric(after1, "mtp_cached_prompt_tokens_total")
        requests = [metric(m, MESSAGES_OK) for m in (before, after1, after2)]
        assert prompt2 > prompt1 / max(1, requests[1] - requests[0]), (prompt2, prompt1, requests)
        assert cached2 > 0.9 * prompt2, (cached2, prompt2, prompt1, requests, r1.stdout[-500:], r2.stdout[-500:])
        assert failed_requests(after2, "/v1/messages") == 0, after2
        assert server.service.engine.active_count == 0
    finally:
        shutil.rmtree(tmp_path / "home", ignore_errors=True)


def test_codex_exec_turn(server, tmp_path):
    codex = npm_bin("codex", "codex", "CODEX_BIN")
    project, codex_home = tmp_path / "project", tmp_path / "codex"
    project.mkdir()
    codex_home.mkdir()
    (codex_home / "config.toml").write_text(
        'model = "tiny"\nmodel_provider = "mtp"\n\n[model_providers.mtp]\nname = "mtp-serve"\n'
        f'base_url = "{server.base_url}"\nwire_api = "responses"\n')
    env = clean_env(tmp_path, "CODEX_", "OPENAI_", "XDG_")
    env["CODEX_HOME"] = str(codex_home)
    try:
        r = subprocess.run([codex, "exec", "--skip-git-repo-check", "Say hello"], cwd=project, env=env, stdin=subprocess.DEVNULL,
                           capture_output=True, text=True, timeout=240)
        text = metrics(server)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        assert metric(text, r'mtp_requests_total\{endpoint="/v1/responses",status="200"\}') >= 1
        assert failed_requests(text, "/v1/responses") == 0, text
        assert server.service.engine.active_count == 0
    finally:
        shutil.rmtree(tmp_path / "home", ignore_errors=True)
