"""The wheel built from the source tree holds every subpackage and its data: installed into a clean
virtual environment (no editable install, the repository off the path), each module imports from there."""

import shutil
import subprocess
import sys
import sysconfig
import textwrap
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SKIP = {".git", ".venv", ".work", "bench", "tests", "build", "dist", "examples", "__pycache__"}

# Every module of the package, imported in the clean environment; the data files the server and the
# loader read at run time must be inside the wheel too.
IMPORT_ALL = textwrap.dedent("""
    import importlib, pkgutil, sys
    from importlib import resources
    import mtp_serve
    prefix = sys.argv[1]
    names = ["mtp_serve"] + [m.name for m in pkgutil.walk_packages(mtp_serve.__path__, "mtp_serve.")]
    for name in names:
        module = importlib.import_module(name)
        assert module.__file__.startswith(prefix), (name, module.__file__)
    for package, pattern in [("mtp_serve.configs", "qwen3_5.json"), ("mtp_serve.server", "ui"),
                             ("mtp_serve.models", "demo"), ("mtp_serve", "native")]:
        assert resources.files(package).joinpath(pattern).exists(), (package, pattern)
    print("\\n".join(names))
""")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel `pip wheel` builds from a copy of the tree (the checkout itself is left untouched)."""
    src = tmp_path_factory.mktemp("src") / "mtp-serve"
    shutil.copytree(REPO, src, ignore=lambda d, names: [n for n in names if n in SKIP or n.endswith(".egg-info")])
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(out), str(src)], check=True, cwd=out)
    (built,) = out.glob("mtp_serve-*.whl")
    return built


def test_wheel_lists_every_package_folder_of_the_tree(wheel):
    """Each folder with an __init__.py under the mapped source folders is in the wheel (vision included)."""
    shipped = {str(Path(n).parent) for n in zipfile.ZipFile(wheel).namelist() if n.endswith("/__init__.py")}
    mapped = {"engine": "mtp_serve/engine", "models": "mtp_serve/models", "server": "mtp_serve/server",
              "configs": "mtp_serve/configs", "mtp_serve": "mtp_serve"}
    expected = {mapped[init.relative_to(REPO).parts[0]] + "/".join([""] + list(init.relative_to(REPO).parts[1:-1]))
                for top in mapped for init in (REPO / top).rglob("__init__.py")}
    assert "mtp_serve/models/vision" in expected
    assert expected <= shipped, sorted(expected - shipped)


def test_every_module_imports_from_the_wheel_in_a_clean_venv(wheel, tmp_path):
    """The wheel installed alone into a fresh venv: every module and the package data load from it, and the
    `mtp-serve` entry point runs."""
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                    "--no-index", str(wheel)], check=True)
    # The dependencies (mlx, fastapi, ...) come from this interpreter's site folders as plain path
    # entries: their .pth files, an editable install of this checkout among them, are not run.
    deps = [p for p in sys.path if p.endswith("-packages")] + [sysconfig.get_paths()["purelib"]]
    (site / "deps.pth").write_text("\n".join(dict.fromkeys(deps)) + "\n")
    done = subprocess.run([str(python), "-c", IMPORT_ALL, str(site)], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    names = set(done.stdout.split())
    helped = subprocess.run([str(env_dir / "bin" / "mtp-serve"), "--help"], capture_output=True, text=True,
                            cwd=tmp_path, timeout=120)
    assert helped.returncode == 0 and "--enable-mtp" in helped.stdout, helped.stderr[-3000:]
    assert {"mtp_serve.models.vision.tower", "mtp_serve.server.parsers", "mtp_serve.engine.prompt_cache",
            "mtp_serve.cli.serve"} <= names
