"""The prompt cache: model state reused across requests (`cache.py`), its
token-block snapshots (`snapshot.py`), the prefix index that finds them
(`prefix_index.py`), the disk tier (`disk.py`, files in `files.py`) and the
settings it opens with (`setup.py`).

Outside this package only two names are used: `PromptCache` and
`open_prompt_cache`.
"""

from .cache import PromptCache
from .setup import open_prompt_cache

__all__ = ["PromptCache", "open_prompt_cache"]
