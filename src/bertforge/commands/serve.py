"""`bertforge serve`: a model directory behind an HTTP API (needs `pip install 'bertforge[serve]'`).

    bertforge serve --model runs/sst2                       # POST /predict, /embed on http://127.0.0.1:8080
    bertforge serve --model runs/mini --quantize int8       # POST /fill-mask, /embed; int8 as in predict
    curl -s localhost:8080/predict -H 'content-type: application/json' -d '{"inputs": "a gorgeous, witty film"}'

A fine-tuned directory serves POST /predict (what `bertforge predict` prints), a pretrained one POST /fill-mask,
any one POST /embed; each takes {"inputs": one input or a list}. GET / is a page to try the model, /docs the API,
/health, /ready, /info and /metrics (Prometheus) the service. Concurrent requests are batched together on one
engine thread (--max-batch-tokens, --max-wait-ms); past --max-queue waiting inputs a request is refused with 503.
SIGTERM stops accepting, finishes what was accepted and exits 0. It listens on loopback unless --host says
otherwise: another address lets other machines call the model (add --api-key).
"""

from __future__ import annotations

from bertforge.commands.arguments import Command
from bertforge.serve.options import ServeOptions


def run_serve(args: ServeOptions) -> int:
    from bertforge.serve import require_extra

    require_extra()
    from bertforge.serve.server import serve

    return serve(args)


COMMANDS = [Command("serve", ServeOptions, run_serve, help="serve a model over HTTP, with dynamic batching and a page",
                    description=__doc__, keeps_freed_memory=True)]
