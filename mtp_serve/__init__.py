"""mtp-serve: lossless MTP speculative decoding on MLX.

Importing the package first sets up the fastest MLX path for this platform
(on Linux CPU: preload OpenBLAS before mlx.core is imported).
"""

from mtp_serve.backend import setup_backend

__version__ = "0.1.0"

BACKEND = setup_backend()
