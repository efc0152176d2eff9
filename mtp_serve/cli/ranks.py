"""mtp-serve across ranks, as MLX's launcher starts it:

    mlx.launch -n 2 --backend ring $(which mtp-serve) --model X --enable-mtp [--parallel tensor|pipeline]

Every rank runs this same program. Each loads only its part of the model
(`models/sharding.py`); they report what they hold; rank 0 serves HTTP with a
`DistributedEngine` and the others follow its steps (`engine/distributed.py`).
Launched as a single process, mtp-serve never comes here.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
from collections import Counter
from typing import Optional

log = logging.getLogger("mtp_serve")

EXIT_RANK_LOST = 3  # rank 0's exit status when the group broke while serving
# Rank 0 alone would decide the prompt cache's hits, and the other ranks hold other
# parts of the state: they would have to store and evict the same snapshots.
PROMPT_CACHE_OFF = ("the prompt cache is off across ranks (the other ranks cannot yet restore the state rank 0 "
                    "would reuse); every prompt is prefilled whole")
DRAIN_S = 5.0  # for the engine to end its step, then for the responses to leave, when rank 0 stops


def add_arguments(p) -> None:
    g = p.add_argument_group("serving across machines (under mlx.launch)")
    g.add_argument("--parallel", choices=("tensor", "pipeline"), default="tensor",
                   help="split every layer across the ranks (tensor) or give each rank a run of layers (pipeline)")
    g.add_argument("--shard-mtp-head", action="store_true",
                   help="tensor parallel: split the MTP head's layer across the ranks too (default: whole on every rank)")
    g.add_argument("--rank-timeout", type=float, default=60.0,
                   help="seconds an engine step may wait for the other ranks before the server gives up (503, exit)")


def prompt_cache_refusal(args) -> Optional[str]:
    """Serving across ranks runs without the prompt cache: asking for it is an error."""
    asked = [flag for flag, value in (("--prompt-cache-bytes", args.prompt_cache_bytes),
                                      ("--prompt-cache-dir", args.prompt_cache_dir)) if value]
    return f"{' and '.join(asked)}: {PROMPT_CACHE_OFF}" if asked else None


class Ranks:
    """This process's place in the group, and the link to the other ranks."""

    def __init__(self, group, args):
        from mtp_serve.engine.distributed import Link
        from mtp_serve.models.sharding import Split

        self.split = Split(group, args.parallel, "sharded" if args.shard_mtp_head else "whole")
        self.link = Link(group)
        self.rank_timeout = args.rank_timeout
        self._server = None  # rank 0's uvicorn server while it serves
        self._stopping = False

    @property
    def rank(self) -> int:
        return self.link.rank

    def announce(self, loaded) -> None:
        """Every rank's host and what it holds, printed by rank 0; decode matmuls get
        an equal share of the cores of a machine running several ranks."""
        from mtp_serve.backend import set_decode_blas_threads
        from mtp_serve.models.sharding import report_lines

        parts = self.link.gather(self.split.describe(loaded.model.model, loaded.model.head))
        here = Counter(p["host"] for p in parts)[parts[self.rank]["host"]]
        if here > 1:
            set_decode_blas_threads(max(1, (os.cpu_count() or 1) // here))
        if self.rank == 0:
            print(f"mtp-serve: {self.link.size} ranks, {self.split.mode} parallel:", flush=True)
            for line in report_lines(parts):
                print(f"  {line}", flush=True)
            print(f"mtp-serve: {PROMPT_CACHE_OFF}", flush=True)

    def follow(self, loaded) -> int:
        """A rank other than 0: run rank 0's steps until it stops."""
        from mtp_serve.engine.distributed import follow

        try:
            follow(loaded.model, loaded.tokenizer, self.link)
        except Exception as e:  # noqa: BLE001 - one line, then a non-zero exit (the launcher stops the others)
            print(f"mtp-serve: rank {self.rank}: stopping: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            return 1
        return 0

    def serve(self, app, engine, host: str, port: int, log_level: str) -> int:
        """Rank 0's uvicorn. A stop signal (an operator's, or the launcher's after another
        rank exited) first ends the engine, so in-flight requests end with a 503 (a stream
        with its error event) and the other ranks are told to stop; then the server drains
        and exits. A broken group (`_fatal`) ends the server the same way. Returns the exit
        status; after a broken group the process exits here (a thread may still sit in a
        collective that never returns)."""
        import uvicorn

        ranks = self

        class Server(uvicorn.Server):
            def handle_exit(self, sig, frame):
                if ranks._stopping:  # a second signal: uvicorn's own handling (SIGINT forces)
                    return super().handle_exit(sig, frame)
                ranks._stopping = True
                threading.Thread(target=ranks._drain, args=(engine,), name="mtp-drain", daemon=True).start()

        self._server = Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                             timeout_graceful_shutdown=DRAIN_S))
        self._server.run()
        if getattr(engine, "fault", None) is None:
            return 0
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_RANK_LOST)

    def _drain(self, engine) -> None:
        engine.stop(timeout=DRAIN_S)
        self._server.should_exit = True

    def _fatal(self, error: BaseException) -> None:
        """The group broke while serving (the engine failed its requests with 503): the
        server drains and exits non-zero; a shutdown that hangs is cut short."""
        print(f"mtp-serve: a rank failed ({type(error).__name__}: {error}); in-flight requests got 503; exiting",
              file=sys.stderr, flush=True)
        if self._server is not None:
            self._server.should_exit = True
        threading.Timer(DRAIN_S * 2, os._exit, args=(EXIT_RANK_LOST,)).start()

    def engine_factory(self):
        """What `create_app` builds rank 0's engine with."""
        from mtp_serve.engine.distributed import DistributedEngine

        return functools.partial(DistributedEngine, link=self.link, mode=self.split.mode,
                                 rank_timeout=self.rank_timeout, on_fatal=self._fatal)


def distributed_ranks(args) -> Optional[Ranks]:
    """The group when launched with several ranks (mlx.launch), else None."""
    import mlx.core as mx

    if not mx.distributed.is_available():
        return None
    group = mx.distributed.init()
    return Ranks(group, args) if group.size() > 1 else None

