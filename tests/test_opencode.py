"""End to end: one `opencode run` turn against the server (offline).

opencode comes from npm (`npm install opencode-ai`); tests/npm_clients.py finds it
($OPENCODE_BIN, or where `./install.sh --test` puts it).
One turn sends two streamed chat requests (a short title request and the main
one, whose system prompt and tool schemas are ~12k tokens with the byte tokenizer).
"""

import json
import os
import shutil
import subprocess

from npm_clients import metric, npm_bin
from test_server_support import serve


def test_opencode_completes_a_turn(checkpoint_dir, tmp_path):
    import httpx

    opencode = npm_bin("opencode", "opencode", "OPENCODE_BIN")
    server = serve(checkpoint_dir("qwen3_5", agreeable=True), served_model_name="tiny", mtp_depth=2, max_context=65536)
    try:
        work, home = tmp_path / "work", tmp_path / "home"
        work.mkdir()
        home.mkdir()
        config = {
            "$schema": "https://opencode.ai/config.json",
            "provider": {
                "local": {
                    "npm": "@ai-sdk/openai-compatible",
                    "name": "mtp-serve",
                    "options": {"baseURL": server.base_url, "apiKey": "none"},
                    # A small output limit: opencode sends it as max_tokens.
                    "models": {"tiny": {"name": "tiny", "limit": {"context": 65536, "output": 16}}},
                }
            },
        }
        (work / "opencode.json").write_text(json.dumps(config))
        # opencode reads OPENCODE_* variables itself (and XDG_* for its dirs): keep them out.
        env = {k: v for k, v in os.environ.items() if not k.startswith(("XDG_", "OPENCODE"))}
        env.update(HOME=str(home), PWD=str(work))  # opencode takes its project directory from $PWD
        r = subprocess.run([opencode, "run", "--pure", "-m", "local/tiny", "Say hello"], cwd=work, env=env,
                           capture_output=True, text=True, timeout=420)
        metrics = httpx.get(server.root + "/metrics").text
        ok = metric(metrics, r'mtp_requests_total\{endpoint="/v1/chat/completions",status="200"\}')
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        assert ok >= 1, metrics
        assert metric(metrics, "mtp_completion_tokens_total") > 0
        assert metric(metrics, "mtp_prompt_tokens_total") > 1000  # the agent's system prompt and tools
        assert server.service.engine.active_count == 0
    finally:
        server.stop()
        if os.environ.get("OPENCODE_KEEP_HOME") is None:
            shutil.rmtree(tmp_path / "home", ignore_errors=True)
