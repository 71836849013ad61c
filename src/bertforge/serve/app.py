"""The HTTP application: the endpoints a model directory gives (`ServedModel`), each request's inputs checked
(`schemas`) and queued for the engine's worker thread (`Batcher`), the health, info and metrics endpoints, and the
page at `/`. Every refusal is a JSON body `{"error": "<field>: <what is wrong and what to do>"}`."""

from __future__ import annotations

import asyncio
import hmac
import importlib.resources
import json
import logging
import time
from collections.abc import Callable, Hashable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from bertforge import __version__
from bertforge.errors import BertforgeError
from bertforge.serve import schemas
from bertforge.serve.batcher import Batcher, Closed, QueueFull
from bertforge.serve.metrics import Metrics
from bertforge.serve.model import ServedModel
from bertforge.serve.options import ServeOptions
from bertforge.serve.schemas import EmbedBody, FillMaskBody, PredictBody, Refused

log = logging.getLogger("bertforge.serve")
OPEN_PATHS = {"/", "/page.js", "/page.css", "/health", "/ready"}  # served without --api-key's token
PAGE_FILES = {"/page.js": "application/javascript", "/page.css": "text/css"}
UNREADABLE = "body: not readable as JSON (nested too deeply); send a flatter body"
CLIENT_GONE = 499  # the status nginx logs for a client that closed its connection first; it receives nothing


def create_app(served: ServedModel, options: ServeOptions) -> Gate:
    """The ASGI app serving `served` (the FastAPI app behind its `Gate`); its engine worker starts and stops with
    the app's lifespan (uvicorn's startup, and its graceful shutdown, which first lets every accepted request
    finish)."""
    metrics = Metrics(lambda: batcher.queued)
    batcher = Batcher(served.run, max_tokens=options.max_batch_tokens, max_wait=options.max_wait_ms / 1000,
                      max_queue=options.max_queue, on_batch=metrics.batch)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        batcher.start()
        yield
        await asyncio.get_running_loop().run_in_executor(None, batcher.close)

    app = FastAPI(title="bertforge", version=__version__, lifespan=lifespan,
                  description=f"`{served.path}` served by bertforge: {', '.join(served.endpoints)}.")
    app.state.batcher, app.state.metrics, app.state.served = batcher, metrics, served
    endpoints = model_endpoints(served, options)
    _add_errors(app, served)
    _add_model_routes(app, served, endpoints, batcher)
    _add_service_routes(app, served, options, batcher, metrics)
    return Gate(app, options, metrics, {r.path for r in app.routes}, endpoints)


def queue_full(batcher: Batcher) -> str:
    return f"the queue is full ({batcher.max_queue} inputs waiting): retry in a moment"


async def _run(receive, batcher: Batcher, served: ServedModel, key: Hashable, items: list, single: bool,
               path: str) -> Response:
    """Queue the request's inputs, wait for its results (or for its client to go away: `receive`, the request's
    own, after its body), answer them."""
    try:
        future = batcher.submit(key, items, served.cost(items))
    except QueueFull:
        raise Refused(503, queue_full(batcher)) from None
    except Closed:
        raise Refused(503, "the server is shutting down") from None
    answer = asyncio.wrap_future(future)
    gone = asyncio.ensure_future(_disconnected(receive))
    await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
    if not answer.done():  # nobody to answer: drop the inputs if they have not started, the results if they have
        future.cancel()
        answer.cancel()
        return Response(status_code=CLIENT_GONE)
    gone.cancel()
    try:
        results = answer.result()
    except BertforgeError as e:  # an input the engine refuses (fill-mask: the [MASK] cut off by truncation)
        raise Refused(422, f"inputs: {e}") from None
    except Exception as e:
        log.exception("the engine failed on a request to %s", path)
        raise Refused(500, f"the engine failed ({type(e).__name__}: {e}); the server keeps serving") from None
    return JSONResponse(results[0] if single else results)


async def _disconnected(receive) -> None:
    """Returns when the client closes its connection (the body has been read by then)."""
    while (await receive())["type"] != "http.disconnect":
        pass


@dataclass(frozen=True)
class Endpoint:
    """A model endpoint: the body it takes, and `plan`: a valid body -> (the batcher's key, the inputs to queue,
    whether one input was sent rather than a list); raises Refused for what pydantic's types do not check."""

    body: type[BaseModel]
    plan: Callable[[Any], tuple[Hashable, list, bool]]


def model_endpoints(served: ServedModel, options: ServeOptions) -> dict[str, Endpoint]:
    """The POST endpoints `served` gives, by path."""
    endpoints = {}
    if served.predictor is not None:
        kind = served.task.kind

        def predict(body: PredictBody) -> tuple[Hashable, list, bool]:
            items, single = schemas.as_list(body.inputs, options.max_inputs)
            return ("/predict",), schemas.predict_records(items, single, kind), single
        endpoints["/predict"] = Endpoint(PredictBody, predict)
    if served.filler is not None:
        def fill_mask(body: FillMaskBody) -> tuple[Hashable, list, bool]:
            items, single = schemas.as_list(body.inputs, options.max_inputs)
            return ("/fill-mask", body.top_k), schemas.check_masked(items, single), single
        endpoints["/fill-mask"] = Endpoint(FillMaskBody, fill_mask)

    def embed(body: EmbedBody) -> tuple[Hashable, list, bool]:
        items, single = schemas.as_list(body.inputs, options.max_inputs)
        if body.pooling == "pooler" and served.encoder.model.pooler is None:
            raise Refused(422, "pooling: this model has no pooler weights; use cls or mean")
        return ("/embed", body.pooling, body.normalize), schemas.check_texts(items, single), single
    endpoints["/embed"] = Endpoint(EmbedBody, embed)
    return endpoints


def _add_model_routes(app: FastAPI, served: ServedModel, endpoints: dict[str, Endpoint], batcher: Batcher) -> None:
    """The model endpoints as FastAPI routes: what /docs and /openapi.json describe. The `Gate` answers these paths
    itself (`Gate._answer`, the same checks and results without FastAPI's routing and dependency machinery); the
    routes answer where the app runs without its Gate."""
    async def run(path: str, body: Any, request: Request) -> Response:
        return await _run(request.receive, batcher, served, *endpoints[path].plan(body), path)

    if "/predict" in endpoints:
        kind = served.task.kind

        @app.post("/predict", summary=f"{served.task.name} ({kind.replace('_', ' ')}) predictions")
        async def predict(body: PredictBody, request: Request) -> Response:
            """One result per input, as `bertforge predict` writes them: classification {label, score, probabilities};
            regression {score}; tagging {entities: [{type, start, end, text}], tags}; question answering {answer,
            start, end, score}; multiple choice {choice, probabilities}. Offsets are characters."""
            return await run("/predict", body, request)

    if "/fill-mask" in endpoints:
        @app.post("/fill-mask", summary="the likeliest tokens behind each [MASK]")
        async def fill_mask(body: FillMaskBody, request: Request) -> Response:
            """Per text, per [MASK] left to right, top_k {token, score} (score: the probability), likeliest first."""
            return await run("/fill-mask", body, request)

    @app.post("/embed", summary="a vector per text")
    async def embed(body: EmbedBody, request: Request) -> Response:
        """Per text its vector (hidden size floats): the final [CLS] state (cls), the mean of the token states
        (mean) or BERT's pooler output (pooler); `normalize` scales each to unit length."""
        return await run("/embed", body, request)


def _add_service_routes(app: FastAPI, served: ServedModel, options: ServeOptions, batcher: Batcher,
                        metrics: Metrics) -> None:
    info = {**served.info(), "version": __version__,
            "limits": {"max_inputs": options.max_inputs, "max_body_bytes": options.max_body_bytes,
                       "max_queue": options.max_queue},
            "batching": {"max_batch_tokens": options.max_batch_tokens, "max_wait_ms": options.max_wait_ms}}
    page = importlib.resources.files("bertforge.serve") / "static"

    @app.get("/health", summary="the process is up")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/ready", summary="the engine takes requests")
    async def ready() -> Response:
        if not batcher.accepting:
            return JSONResponse({"ready": False, "error": "the engine is not running"}, status_code=503)
        return JSONResponse({"ready": True, "queued": batcher.queued})

    @app.get("/info", summary="the model, its engine and the server's limits")
    async def model_info() -> dict:
        return info

    @app.get("/metrics", summary="Prometheus metrics", response_class=PlainTextResponse)
    async def prometheus() -> Response:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/", include_in_schema=False)
    async def index() -> Response:
        return HTMLResponse((page / "index.html").read_text(encoding="utf-8"))

    for path, media_type in PAGE_FILES.items():
        text = (page / path.lstrip("/")).read_text(encoding="utf-8")
        app.add_api_route(path, lambda text=text, media_type=media_type: Response(text, media_type=media_type),
                          include_in_schema=False)


def _error(status: int, message: str, headers: dict | None = None, **extra: Any) -> JSONResponse:
    return JSONResponse({"error": message, **extra}, status_code=status, headers=headers)


FIELDS = {"inputs", "text", "text_pair", "question", "context", "choices", "top_k", "pooling", "normalize"}


def _field(loc: tuple) -> str:
    """pydantic's location of an error as the field's name: ("body", "inputs", "list[...]", 2, "Record", "context")
    -> inputs[2].context (the names of a union's members, which pydantic puts in the location, left out)."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in FIELDS:
            out += f".{part}" if out else part
    return out or "body"


def _validation_message(errors: list[dict]) -> str:
    """One line for pydantic's errors: those of the deepest field (where a union's members all failed, what each
    wanted, joined with "or"); a body that is not JSON says where it breaks."""
    for err in errors:
        if err["type"] == "json_invalid":
            at = err["loc"][-1] if isinstance(err["loc"][-1], int) else "?"
            return f"body: not valid JSON (at character {at}: {err.get('ctx', {}).get('error', err['msg'])})"
    fields = [_field(err["loc"]) for err in errors]
    deepest = max(fields, key=lambda f: (f.count(".") + f.count("["), len(f)))
    wanted = dict.fromkeys(err["msg"] for f, err in zip(fields, errors, strict=True) if f == deepest)
    return f"{deepest}: {' or '.join(wanted)}"


def _refusal(e: Refused) -> JSONResponse:
    return _error(e.status, e.message, {"Retry-After": "1"} if e.status == 503 else None)


def _invalid(errors: list[dict]) -> JSONResponse:
    """422 for pydantic's errors: one line naming the field, and each error under "detail"."""
    detail = [{"field": _field(err["loc"]), "message": err["msg"], "type": err["type"]} for err in errors]
    return _error(422, _validation_message(errors), detail=detail)


def _add_errors(app: FastAPI, served: ServedModel) -> None:
    has = ", ".join([f"POST {e}" for e in served.endpoints] + ["GET /info", "GET /docs"])

    @app.exception_handler(Refused)
    async def refused(request: Request, e: Refused) -> Response:
        return _refusal(e)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> Response:
        return _invalid(e.errors())

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> Response:
        if e.status_code == 404:
            why = served.missing.get(request.url.path)
            message = f"{request.url.path}: {why}" if why else f"no endpoint {request.url.path}"
            return _error(404, f"{message}; this model serves {has}")
        if e.status_code == 405:
            return _error(405, f"{request.method} {request.url.path}: method not allowed; this model serves {has}",
                          getattr(e, "headers", None))
        if e.status_code == 400:  # FastAPI's: a body that json.loads gave up on other than as invalid JSON
            return _error(400, UNREADABLE)
        return _error(e.status_code, str(e.detail), getattr(e, "headers", None))


class Gate:
    """The ASGI layer in front of the app: the API key, the body size limit (a body is read whole, up to the
    limit, before the app sees it), and every request's status and latency for the metrics."""

    def __init__(self, app: FastAPI, options: ServeOptions, metrics: Metrics, paths: set[str],
                 endpoints: dict[str, Endpoint]):
        self.app, self.options, self.metrics, self.paths, self.endpoints = app, options, metrics, paths, endpoints
        self.state = app.state
        # a full queue's 503, rendered once: a burst's refusals are most of its requests
        body = json.dumps({"error": queue_full(app.state.batcher)}).encode()
        self._full = ([(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (b"retry-after", b"1")], body)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status = time.perf_counter(), [500]
        self.metrics.arrived()

        async def sent(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self._pass(scope, receive, sent)
        finally:
            endpoint = scope["path"] if scope["path"] in self.paths else "other"
            self.metrics.request(endpoint, status[0], time.perf_counter() - start)

    async def _pass(self, scope, receive, send) -> None:
        if self.options.api_key is not None and scope["path"] not in OPEN_PATHS and not self._authorized(scope):
            await _error(401, "Authorization: give the server's --api-key as `Authorization: Bearer KEY`",
                         {"WWW-Authenticate": "Bearer"})(scope, receive, send)
            return
        if scope["method"] == "POST" and self.state.batcher.full and scope["path"] in self.endpoints:
            # refused before its body is read or parsed: under a burst, each refusal costs the event loop (which the
            # accepted requests' answers also wait for) as little as it can
            headers, body = self._full
            await send({"type": "http.response.start", "status": 503, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        body = await self._body(scope, receive)
        refusal = None
        if body is None:
            refusal = _error(413, f"body: larger than the server's limit of {self.options.max_body_bytes} bytes "
                                  "(send fewer inputs per request, or start it with a larger --max-body-bytes)")
        else:
            try:
                body.decode("utf-8")  # every body the endpoints take is JSON, which is UTF-8
            except UnicodeDecodeError as e:
                refusal = _error(400, f"body: not valid UTF-8 (byte {body[e.start]:#04x} at {e.start}); send JSON "
                                      "encoded in UTF-8")
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        endpoint = self.endpoints.get(scope["path"]) if scope["method"] == "POST" else None
        if endpoint is not None:
            response = await self._answer(endpoint, body, scope["path"], receive)
            await response(scope, receive, send)
            return
        if scope["method"] == "POST":  # every POST body is JSON: read it as JSON whatever the client declared
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _answer(self, endpoint: Endpoint, body: bytes, path: str, receive) -> Response:
        """A model endpoint's request, answered as its FastAPI route would (the same checks, refusals and results)
        at a fraction of the event loop's time a request: under load that time is taken from the engine."""
        try:
            parsed = json.loads(body)
        except json.JSONDecodeError as e:  # as FastAPI words it, for `_validation_message`
            return _invalid([{"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error",
                              "ctx": {"error": e.msg}}])
        except RecursionError:
            return _error(400, UNREADABLE)
        try:
            valid = endpoint.body.model_validate(parsed, from_attributes=True)  # as FastAPI validates (its wording)
            return await _run(receive, self.state.batcher, self.state.served, *endpoint.plan(valid), path)
        except ValidationError as e:
            return _invalid(e.errors())
        except Refused as e:
            return _refusal(e)

    def _authorized(self, scope) -> bool:
        given = dict(scope["headers"]).get(b"authorization", b"")
        return hmac.compare_digest(given, b"Bearer " + self.options.api_key.encode())

    async def _body(self, scope, receive) -> bytes | None:
        """The whole body, or None past the limit (read no further: the declared length alone may refuse it)."""
        limit = self.options.max_body_bytes
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"".join(chunks)
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                return None
            if not message.get("more_body", False):
                return b"".join(chunks)
