"""The prompt cache: model state reused across requests (`cache.py`), its
token-block snapshots (`snapshot.py`), the prefix index that finds them
(`prefix_index.py`), the disk tier (`disk.py`, files in `files.py`) and the
settings it opens with (`setup.py`).

Outside this package only these names are used: `PromptCache`,
`open_prompt_cache` and `PromptCacheUnavailable`.
"""

from .cache import PromptCache
from .setup import PromptCacheUnavailable, open_prompt_cache

__all__ = ["PromptCache", "PromptCacheUnavailable", "open_prompt_cache"]
