"""A stop that drains: on SIGTERM or Ctrl-C the server stops accepting connections, lets the
running requests finish for `grace` seconds (--shutdown-grace), then ends the rest with a
final event in each API's shape (the engines stop: every open stream gets its API's error
event, then `[DONE]` where the API has one; a waiting non-streamed request gets a 503). A
second signal ends them at once, the same way; a third (Ctrl-C) quits without waiting.

    DrainingServer(uvicorn.Config(app, ...), end_requests=app.state.models.stop_engines, grace=10).run()
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Callable, Optional

import uvicorn
from sse_starlette.sse import AppStatus

log = logging.getLogger("mtp_serve")
END_SECONDS = 10.0  # after the grace: for the final events to be sent, before uvicorn cancels what is left


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, end_requests: Callable[[], None], grace: float):
        config.timeout_graceful_shutdown = grace + END_SECONDS
        super().__init__(config)
        AppStatus.disable_automatic_graceful_drain()  # sse-starlette would cut every stream at the first signal
        self.end_requests = end_requests
        self.grace = grace
        self._ending: Optional[threading.Thread] = None

    def handle_exit(self, sig, frame) -> None:
        if self.should_exit and self._ending is None:  # a second signal: end the running requests now
            log.info("second stop signal: ending the running requests now")
            self.end_now()
            return
        super().handle_exit(sig, frame)

    def end_now(self) -> None:
        """Stop the engines (off the event loop: a stop joins the engine thread): every running
        request ends with its API's final events."""
        if self._ending is None:
            self._ending = threading.Thread(target=self.end_requests, name="mtp-shutdown", daemon=True)
            self._ending.start()

    async def shutdown(self, sockets=None) -> None:
        if self.server_state.connections:
            log.info("draining: open requests may finish within %gs (--shutdown-grace); a second signal ends them now",
                     self.grace)
        timer = asyncio.get_running_loop().call_later(self.grace, self.end_now)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()
        if self._ending is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._ending.join, END_SECONDS)
