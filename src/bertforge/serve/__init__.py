"""`bertforge serve`: a model directory behind an HTTP API, with dynamic batching and a page to try it.

The modules by job: `options` (the command's options; standard library only), `model` (the engines a directory
gives and the endpoints they serve), `schemas` (request bodies and their checks), `batcher` (the queue and the
worker thread that owns the engines), `metrics` (Prometheus text), `app` (the FastAPI app), `server` (binding,
uvicorn, shutdown), `static/` (the page). Everything but `options` and `batcher` needs the `serve` extra;
`require_extra` says so in one line.
"""

from __future__ import annotations

import importlib.util

from bertforge.errors import BertforgeError

EXTRA_PACKAGES = ("fastapi", "uvicorn")


def require_extra() -> None:
    """Refuse, in one line naming the fix, when the serve extra's packages are missing."""
    missing = [name for name in EXTRA_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise BertforgeError(f"bertforge serve needs {' and '.join(missing)}: pip install 'bertforge[serve]'")
