"""The options of `bertforge serve`, declared as the library's other options are (`bertforge.options.option`).

This module imports only the standard library and `bertforge.options`, so that `bertforge serve --help` and its
`error:` lines come without loading torch or the web stack.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from bertforge.bounds import Bound, at_least
from bertforge.errors import BertforgeError
from bertforge.options import EngineOptions, option, same_as

PORT = Bound(lo=0, hi=65535, why="a TCP port (0: any free one, printed at start)")


@dataclass
class ServeOptions:
    """What `bertforge serve` serves, where, and its batching and limits (`bertforge.serve.server.serve`). Its
    device, quantize, precision and backend are `EngineOptions`' (`engine()` gives them as one)."""

    model: str = option(help="model directory: a fine-tuned one serves POST /predict, a pretrained one with its "
                             "masked-LM head POST /fill-mask, any one POST /embed")
    host: str = option("127.0.0.1", help="address to listen on (default: loopback only; any other address lets "
                                         "other machines call the model, so consider --api-key)")
    port: int = option(8080, help="TCP port (0: any free one, printed at start)", bound=PORT)
    api_key: str | None = option(None, help="require `Authorization: Bearer KEY` on every endpoint but /, "
                                            "/health and /ready")
    device: str | None = same_as(EngineOptions, "device")
    quantize: str | None = same_as(EngineOptions, "quantize")
    precision: str = same_as(EngineOptions, "precision")
    backend: str = same_as(EngineOptions, "backend")
    max_batch_tokens: int = option(8192, help="tokens (estimated) of the requests run together in one engine call",
                                   bound=at_least(1, "more than 2**24 tokens at once fit no device", at_most=2**24))
    max_wait_ms: float = option(2.0, help="how long the engine waits for more requests to join a batch before "
                                          "running it, while requests overlap (a lone client's requests run at once)",
                                 bound=at_least(0, "a minute at most: longer is past any client's timeout",
                                                at_most=60_000))
    max_queue: int = option(1024, help="inputs waiting at most; past it requests are refused at once with 503 "
                                       "and Retry-After",
                               bound=at_least(1, "2**24 waiting inputs at most", at_most=2**24))
    max_inputs: int = option(256, help="inputs in one request at most (more: 413)",
                              bound=at_least(1, "2**20 inputs a request at most", at_most=2**20))
    max_body_bytes: int = option(1_000_000, help="request body size at most, in bytes (more: 413)",
                                 bound=at_least(64, "2 GiB at most", at_most=2**31))
    access_log: bool = option(False, help="log every request on standard error")

    def __post_init__(self) -> None:
        self.engine()  # what cannot run together refused as these are made, before the web stack loads
        if self.max_inputs > self.max_queue:
            raise BertforgeError(f"--max-inputs {self.max_inputs} is above --max-queue {self.max_queue}: a request "
                                 "that large could never be queued; raise --max-queue or lower --max-inputs")

    def engine(self) -> EngineOptions:
        """The options of the engines that serve the model (checked together as they are made)."""
        return EngineOptions(**{f.name: getattr(self, f.name) for f in dataclasses.fields(EngineOptions)})
