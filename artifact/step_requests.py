"""How a step's tokens group into requests: the layout both the compiled step's runtime and the
IR interpreter read (a request's tokens in one step are at consecutive positions, ascending)."""

from __future__ import annotations

import numpy as np

from dsv4c.errors import UsageError


def request_groups(positions: np.ndarray, seq_ids: np.ndarray):
    """Yield (seq, token indices, first position) for each request in a step.

    A request's tokens in one step are consecutive positions in ascending order (the
    runtime guarantees it; the interpreter checks it)."""
    for seq in dict.fromkeys(seq_ids.tolist()):
        idx = np.nonzero(seq_ids == seq)[0]
        pos = positions[idx]
        if np.any(np.diff(pos) != 1):
            raise UsageError(f"request {seq}: positions in one step must be consecutive, got {pos.tolist()}")
        yield seq, idx, int(pos[0])
