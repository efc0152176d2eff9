import mtp_serve  # noqa: F401  (must precede mlx imports: sets up the backend)

import contextlib
import io
import os

import pytest

# Test tiers. A plain `pytest` runs the fast tier, for local work; `--all-tiers` (the
# README's test command, which CI runs) runs every tier. An explicit `-m` picks for itself.
SLOW_TIERS = ("e2e", "agents", "slow", "browser", "distribution")


def pytest_addoption(parser):
    parser.addoption("--all-tiers", action="store_true",
                     help="run every tier (e2e, agents, slow, browser, distribution) besides the fast one; CI does")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--all-tiers") or config.getoption("markexpr") or os.environ.get("MTP_SERVE_ALL_TIERS"):
        return
    kept = [i for i in items if not any(i.get_closest_marker(t) for t in SLOW_TIERS)]
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in kept])
        items[:] = kept
        config._mtp_tiers_note = True


def pytest_runtest_setup(item):
    """A native kernel that should have built here but did not (tests/support/native.py, under CI)."""
    mark = item.get_closest_marker("native_build_failed")
    if mark is not None:
        pytest.fail(mark.args[0], pytrace=False)


def pytest_terminal_summary(terminalreporter, config):
    if getattr(config, "_mtp_tiers_note", False):
        terminalreporter.write_line(f"fast tier only: tests marked {', '.join(SLOW_TIERS)} were deselected "
                                    "(`--all-tiers` runs everything, as CI does)")

from mtp_serve.testing.synthetic import write_synthetic_checkpoint


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory):
    """Factory: a synthetic HF-layout checkpoint per (family, options), written once per session."""
    made = {}

    def make(family: str = "qwen3_5", **options):
        key = (family, tuple(sorted(options.items())))
        if key not in made:
            name = family + "".join(f"-{k}={v}" for k, v in sorted(options.items()))
            made[key] = write_synthetic_checkpoint(tmp_path_factory.mktemp("ckpt") / name, family, **options)
        return made[key]

    return make


@pytest.fixture(scope="session")
def loaded(checkpoint_dir):
    """Factory: a loaded synthetic model, cached per (family, options)."""
    from mtp_serve.models.loader import load_model

    cache = {}

    def load(family: str = "qwen3_5", **options):
        key = (family, tuple(sorted(options.items())))
        if key not in cache:
            cache[key] = load_model(str(checkpoint_dir(family, **options)))
        return cache[key]

    return load


@pytest.fixture(scope="session")
def demo_model():
    """The shipped demo model (a trained head: drafting pays on it)."""
    from mtp_serve.models.demo_model import default_model_path
    from mtp_serve.models.loader import load_model

    return load_model(default_model_path())


@pytest.fixture(scope="session")
def stock_converted(tmp_path_factory):
    """Factory: `src` converted by stock mlx-lm (which drops the MTP head), once per
    (src, quantize); 4-bit quantization uses group size 32."""
    from mlx_lm.convert import convert

    made = {}

    def make(src, quantize: bool = False):
        key = (str(src), quantize)
        if key not in made:
            out = tmp_path_factory.mktemp("stock") / ("q4" if quantize else "plain")
            with contextlib.redirect_stdout(io.StringIO()):
                convert(str(src), str(out), quantize=quantize, q_group_size=32 if quantize else None, q_bits=4 if quantize else None)
            made[key] = out
        return made[key]

    return make


@pytest.fixture(scope="session")
def scripted_checkpoint(tmp_path_factory):
    """The scripted model of tests/support/server.py (the committed one while it is current,
    else trained once per session): fixed replies with reasoning, tool calls and malformed tool text."""
    from support.server import write_scripted_checkpoint

    return write_scripted_checkpoint(tmp_path_factory.mktemp("scripted") / "model")


@pytest.fixture(scope="module")
def server(checkpoint_dir):
    """A live server (MTP depth 2) on the agreeable synthetic model, one per test module."""
    from support.server import serve

    # Fixed depth: on the tiny model drafting would not pay, and the measured policy would stop it.
    s = serve(checkpoint_dir("qwen3_5", agreeable=True), mtp_depth=2, fixed_depth=True)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def scripted(scripted_checkpoint):
    """A live server on the scripted model, one per test module."""
    from support.server import serve

    s = serve(scripted_checkpoint)
    yield s
    s.stop()
