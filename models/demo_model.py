"""Where the project's embedded demo model lives."""

from pathlib import Path

DEMO_MODEL_DIR = Path(__file__).resolve().parent / "demo"


def default_model_path() -> str:
    if not (DEMO_MODEL_DIR / "config.json").exists():
        raise FileNotFoundError(
            f"the embedded demo model is missing ({DEMO_MODEL_DIR}); pass --model PATH_OR_REPO"
        )
    return str(DEMO_MODEL_DIR)
