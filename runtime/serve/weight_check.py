"""``serve``'s background check of the weights: once the server is ready, a low-priority thread
hashes the files its load did not (the weight shards and Engram tables); a mismatch turns
``/health`` to 503 and stops the server with exit status 1."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from pathlib import Path
from typing import Callable

from prometheus_client import Gauge

from dsv4c.artifact.manifest import Manifest, check_large_files
from dsv4c.errors import ArtifactError

# Between a mismatch (``/health`` answers 503 and names the file) and the start of the graceful
# shutdown (which closes the listening socket): a health check or client of that moment gets the
# cause rather than a refused connection.
UNHEALTHY_SECONDS = 1.0


class WeightCheck:
    """The state of the weights' sha256 check: the ``dsv4c_weights_verified`` gauge (1 once every file
    matched: ``verified`` when ``--verify`` hashed them before the engine started, else when the
    background check ends) and ``failure``, the one-line error naming the file that did not."""

    def __init__(self, gauge: Gauge, verified: bool):
        self.gauge, self.failure = gauge, None
        gauge.set(int(verified))

    def start(self, directory: Path, manifest: Manifest, event_loop: asyncio.AbstractEventLoop,
              on_mismatch: Callable[[], None]) -> None:
        """Hash the large files on a thread of their own; ``on_mismatch`` is called on ``event_loop``
        ``UNHEALTHY_SECONDS`` after a mismatch was found and logged."""
        def run() -> None:
            if sys.platform == "linux":
                # Linux keeps a nice value per thread: only this one yields the CPU to the engine's.
                os.nice(19)
            try:
                check_large_files(directory, manifest)
            except (ArtifactError, OSError) as e:  # OSError: a file removed or unreadable since the load
                self.failure = str(e) if isinstance(e, ArtifactError) else f"{directory}: unreadable weight file: {e}"
                print(f"dsv4c serve: the background weight check failed: {e}; stopping the server",
                      file=sys.stderr, flush=True)
                event_loop.call_soon_threadsafe(event_loop.call_later, UNHEALTHY_SECONDS, on_mismatch)
                return
            self.gauge.set(1)

        threading.Thread(target=run, name="dsv4c-weight-check", daemon=True).start()
