"""`bertforge serve` on a free loopback port: every endpoint of each kind of model against the engines' own outputs,
batching, the limits and refusals, the queue bound, a client that goes away, and SIGTERM draining.

Models are tiny and random (H 32, 2 layers) with an inline vocabulary. Servers run in-process (uvicorn in a thread)
except for SIGTERM, which needs a process of its own. Every wait is bounded.
"""

import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install 'bertforge[serve]')")
httpx = pytest.importorskip("httpx", reason="httpx is not installed (pip install 'bertforge[serve]')")

from serve_helpers import LIMIT, Gate, model_dirs, post, running, wait_for  # noqa: E402

from bertforge.cli import main  # noqa: E402
from bertforge.errors import BertforgeError  # noqa: E402
from bertforge.infer import Encoder, EngineOptions, MaskFiller, predict_records  # noqa: E402

TEXTS = ["the film was good .", "bad", "the quick brown fox jumps over the lazy dog , and the dog was lazy .",
         "john smith lives in paris", "", "a great movie , the plot", "é"]
SENTENCES = [t for t in TEXTS if t]  # predict refuses an empty text, as `bertforge predict` does
MASKED = ["the [MASK] was good .", "[MASK]", "the quick [MASK] fox jumps over the [MASK] dog .", "a [MASK] movie"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return model_dirs(tmp_path_factory.mktemp("serve"))


@pytest.fixture(scope="module")
def pretrained(models):
    with running(models["mlm"]) as served:
        yield served


@pytest.fixture(scope="module")
def classifier(models):
    with running(models["clf"]) as served:
        yield served


def close(actual, expected, tol=1e-5) -> None:
    """JSON results equal, floats to `tol` (a batch padded otherwise rounds otherwise)."""
    assert json.dumps(actual, sort_keys=True).count(",") == json.dumps(expected, sort_keys=True).count(",")
    if isinstance(expected, dict):
        assert actual.keys() == expected.keys()
        for k in expected:
            close(actual[k], expected[k], tol)
    elif isinstance(expected, list):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected, strict=True):
            close(a, e, tol)
    elif isinstance(expected, float):
        assert actual == pytest.approx(expected, abs=tol)
    else:
        assert actual == expected


def test_pretrained_model_serves_fill_mask_and_embed_as_the_engines_do(pretrained, models):
    url, _ = pretrained
    filler, encoder = MaskFiller(models["mlm"]), Encoder(models["mlm"])
    r = post(url, "/fill-mask", {"inputs": MASKED, "top_k": 3})
    assert r.status_code == 200
    close(r.json(), filler.fill(MASKED, top_k=3))
    close(post(url, "/fill-mask", {"inputs": MASKED[2]}).json(), filler.fill(MASKED[2]))
    for pooling in ("cls", "mean"):
        for normalize in (False, True):
            r = post(url, "/embed", {"inputs": TEXTS, "pooling": pooling, "normalize": normalize})
            close(r.json(), encoder.embed(TEXTS, pooling=pooling, normalize=normalize).tolist())
    close(post(url, "/embed", {"inputs": TEXTS[0]}).json(), encoder.embed(TEXTS[:1])[0].tolist())
    r = post(url, "/predict", {"inputs": "the film"})
    assert r.status_code == 404 and "no task head" in r.json()["error"] and "POST /fill-mask, POST /embed" in \
        r.json()["error"]
    info = httpx.get(url + "/info", timeout=LIMIT).json()
    assert info["kind"] == "pretrained" and info["endpoints"] == ["/fill-mask", "/embed"]
    assert info["max_length"] == 64 and info["engine"] == "torch" and info["weights_bytes"] > 0


def test_classifier_serves_predict_as_bertforge_predict_does(classifier, models, capsys):
    url, state = classifier
    assert state.served.encoder.model is state.served.predictor.task_model.model.bert  # one copy of the weights
    records = [{"text": t} for t in SENTENCES] + [{"text": "good", "text_pair": "the plot was bad"}]
    r = post(url, "/predict", {"inputs": [*SENTENCES, records[-1]]})
    assert r.status_code == 200
    close(r.json(), predict_records(models["clf"], records))
    assert main(["predict", "--model", str(models["clf"]), "--text", TEXTS[0]]) == 0
    close(post(url, "/predict", {"inputs": TEXTS[0]}).json(), json.loads(capsys.readouterr().out))
    close(post(url, "/embed", {"inputs": TEXTS, "pooling": "pooler"}).json(),
          Encoder(models["clf"]).embed(TEXTS, pooling="pooler").tolist())
    r = post(url, "/fill-mask", {"inputs": "the [MASK]"})
    assert r.status_code == 404 and "masked-LM head" in r.json()["error"] and "POST /predict" in r.json()["error"]
    info = httpx.get(url + "/info", timeout=LIMIT).json()
    assert info["kind"] == "classification" and info["labels"] == ["negative", "positive"]
    assert info["endpoints"] == ["/predict", "/embed"] and info["max_length"] == 32


def test_tagger_and_reader_predict_spans_as_bertforge_predict_does(models):
    text = "john  smith lives in paris ."
    with running(models["ner"]) as (url, _):
        [entities] = post(url, "/predict", {"inputs": [text]}).json()
        assert entities == predict_records(models["ner"], [{"text": text}])[0]
        assert [text[e["start"]:e["end"]] for e in entities["entities"]] == text.split()
    context = "john smith lives in paris and works in the film"
    records = [{"question": "where does john live ?", "context": context}, {"text": "who ?", "text_pair": context}]
    with running(models["qa"]) as (url, _):
        answers = post(url, "/predict", {"inputs": records}).json()
        close(answers, predict_records(models["qa"], records))
        assert all(context[a["start"]:a["end"]] == a["answer"] for a in answers)
        r = post(url, "/predict", {"inputs": "a question without its context"})
        assert r.status_code == 422 and r.json()["error"].startswith("inputs.context: a question answering model")


def test_regression_and_multiple_choice_predict_as_bertforge_predict_does(models):
    pairs = [{"text": "the film was good", "text_pair": "a great movie"}, {"text": "bad", "text_pair": "good"}]
    with running(models["reg"]) as (url, _):
        close(post(url, "/predict", {"inputs": pairs}).json(), predict_records(models["reg"], pairs))
    choices = [{"context": "the dog jumps", "choices": ["over the fox", "in paris", "the plot"]}]
    with running(models["mc"]) as (url, _):
        close(post(url, "/predict", {"inputs": choices[0]}).json(), predict_records(models["mc"], choices)[0])
        r = post(url, "/predict", {"inputs": {"context": "the dog", "choices": []}})
        assert r.status_code == 422 and r.json()["error"].startswith("inputs.choices: ")


@pytest.mark.slow  # exports to ONNX first
def test_onnx_backend_serves_what_predict_and_embed_give_on_it(models):
    pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (pip install 'bertforge[onnx]')")
    with running(models["clf"], backend="onnx") as (url, _):
        close(post(url, "/predict", {"inputs": SENTENCES}).json(),
              predict_records(models["clf"], [{"text": t} for t in SENTENCES], EngineOptions(backend="onnx")))
        close(post(url, "/embed", {"inputs": TEXTS, "pooling": "mean"}).json(),
              Encoder(models["clf"], EngineOptions(backend="onnx")).embed(TEXTS, pooling="mean").tolist())
        assert httpx.get(url + "/info", timeout=LIMIT).json()["engine"] == "onnx"


def test_service_endpoints_health_ready_metrics_docs_and_page(classifier):
    url, _ = classifier
    assert httpx.get(url + "/health", timeout=LIMIT).json() == {"status": "ok"}
    assert httpx.get(url + "/ready", timeout=LIMIT).json()["ready"] is True
    assert post(url, "/predict", {"inputs": ["good", "bad"]}).status_code == 200
    metrics = httpx.get(url + "/metrics", timeout=LIMIT)
    assert metrics.headers["content-type"].startswith("text/plain")
    lines = metrics.text.splitlines()
    assert any(line.startswith('bertforge_requests_total{endpoint="/predict",code="200"} ') for line in lines)
    assert any(line.startswith('bertforge_request_seconds_bucket{endpoint="/predict",le="+Inf"} ') for line in lines)
    assert any(line.startswith("bertforge_batch_inputs_count ") for line in lines)
    assert "bertforge_queue_inputs 0" in lines
    schema = httpx.get(url + "/openapi.json", timeout=LIMIT).json()
    assert {"/predict", "/embed", "/health", "/info", "/metrics"} <= set(schema["paths"])
    assert "/fill-mask" not in schema["paths"]
    assert "swagger" in httpx.get(url + "/docs", timeout=LIMIT).text.lower()
    page = httpx.get(url + "/", timeout=LIMIT)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert httpx.get(url + "/page.js", timeout=LIMIT).status_code == 200


BAD = [  # (body as bytes or JSON, status, the start of the error)
    (b'{"inputs": ', 422, "body: not valid JSON"),
    (b'{"inputs": "\xff"}', 400, "body: not valid UTF-8"),
    (b'["a list"]', 422, "body"),
    ({}, 422, "inputs: Field required"),
    ({"inputs": []}, 422, "inputs: "),
    ({"inputs": [3]}, 422, "inputs[0]: Input should be a valid string"),
    ({"inputs": 3}, 422, "inputs: Input should be a valid string"),
    ({"inputs": "x", "extra": 1}, 422, "body"),
    ({"inputs": [{"txt": "x"}]}, 422, "inputs[0]"),
    ({"inputs": [{"context": "x"}]}, 422, "inputs[0].text: a classification model needs text"),
    (b'{"inputs": ["ok", "\\ud800"]}', 422, "inputs[1]: not valid Unicode"),  # JSON's escape of a lone surrogate
    ({"inputs": ["a"] * 9}, 413, "inputs: 9 inputs, more than the 8"),
    ({"inputs": "x" * 3000}, 413, "body: larger than the server's limit of 2048 bytes"),
]


@pytest.mark.slow  # dozens of requests
def test_bad_requests_get_a_4xx_naming_the_field_and_the_server_keeps_serving(models, classifier):
    deep = httpx.post(classifier[0] + "/predict", content=b"[" * 100_000 + b"]" * 100_000, timeout=LIMIT)
    assert deep.status_code == 400 and deep.json()["error"].startswith("body: not readable as JSON")
    with running(models["clf"], max_inputs=8, max_body_bytes=2048) as (url, _):
        for body, status, error in BAD:
            if isinstance(body, bytes):
                r = httpx.post(url + "/predict", content=body, headers={"content-type": "application/json"},
                               timeout=LIMIT)
            else:
                r = post(url, "/predict", body)
            assert (r.status_code, r.json()["error"][:len(error)]) == (status, error), body
        r = httpx.post(url + "/predict", content=b'{"inputs": "good"}', timeout=LIMIT)  # no content-type: still JSON
        assert r.status_code == 200 and r.json()["label"] in ("negative", "positive")
        chunked = httpx.post(url + "/predict", content=iter([b'{"inputs": "', b"x" * 3000, b'"}']), timeout=LIMIT)
        assert chunked.status_code == 413  # no Content-Length: refused as the body arrives past the limit
        r = httpx.get(url + "/predict", timeout=LIMIT)
        assert r.status_code == 405 and "POST /predict" in r.json()["error"]
        r = post(url, "/embed", {"inputs": "x", "pooling": "max"})
        assert r.status_code == 422 and r.json()["error"].startswith("pooling: ")
        assert post(url, "/predict", {"inputs": "good"}).status_code == 200
    with running(models["mlm"]) as (url, _):
        r = post(url, "/fill-mask", {"inputs": ["the [MASK]", "no mask here"]})
        assert r.status_code == 422 and r.json()["error"].startswith("inputs[1]: no [MASK]")
        assert post(url, "/fill-mask", {"inputs": "[MASK]", "top_k": 0}).status_code == 422
        r = post(url, "/fill-mask", {"inputs": "the " * 100 + "[MASK]"})  # the [MASK] truncated away
        assert r.status_code == 422 and "no [MASK]" in r.json()["error"]
        r = post(url, "/embed", {"inputs": "x", "pooling": "pooler"})  # a masked-LM-only model has no pooler
        assert r.status_code == 422 and r.json()["error"].startswith("pooling: ")


@pytest.mark.slow  # waits out the batching window
def test_concurrent_requests_run_together_and_get_what_they_get_one_by_one(classifier):
    url, state = classifier
    texts = SENTENCES * 3
    alone = [post(url, "/predict", {"inputs": t}).json() for t in texts]
    with Gate(state) as gate, ThreadPoolExecutor(len(texts) + 1) as pool:
        first = pool.submit(post, url, "/predict", {"inputs": "the first"})
        wait_for(gate.entered.is_set, "the engine to take the first request")
        futures = [pool.submit(post, url, "/predict", {"inputs": t}) for t in texts]
        wait_for(lambda: state.batcher.queued == len(texts), "every request to be queued")
        gate.open()
        together = [f.result(LIMIT).json() for f in futures]
        assert first.result(LIMIT).status_code == 200
    assert gate.calls == [1, len(texts)]  # one engine call for all the queued requests
    close(together, alone)


def test_past_the_queue_bound_a_request_is_refused_at_once_and_the_accepted_are_answered(models):
    with (running(models["clf"], max_queue=4, max_inputs=4) as (url, state), Gate(state) as gate,
          ThreadPoolExecutor(8) as pool):
        first = pool.submit(post, url, "/predict", {"inputs": "first"})
        wait_for(gate.entered.is_set, "the engine to take the first request")
        queued = [pool.submit(post, url, "/predict", {"inputs": ["good", "bad"]}) for _ in range(2)]
        wait_for(lambda: state.batcher.queued == 4, "4 inputs to be queued")
        start = time.monotonic()
        r = post(url, "/predict", {"inputs": "one too many"})
        assert time.monotonic() - start < 1
        assert r.status_code == 503 and r.headers["retry-after"] == "1" and "queue is full" in r.json()["error"]
        gate.open()
        assert [f.result(LIMIT).status_code for f in [first, *queued]] == [200, 200, 200]
        assert [len(f.result(LIMIT).json()) for f in queued] == [2, 2]


def test_a_client_that_goes_away_is_dropped_from_the_queue(classifier):
    url, state = classifier
    host, port = url.removeprefix("http://").split(":")
    with Gate(state) as gate, ThreadPoolExecutor(1) as pool:
        first = pool.submit(post, url, "/predict", {"inputs": "first"})
        wait_for(gate.entered.is_set, "the engine to take the first request")
        body = json.dumps({"inputs": ["never", "answered"]}).encode()
        with socket.create_connection((host, int(port)), timeout=LIMIT) as raw:
            raw.sendall(b"POST /predict HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                        b"content-length: %d\r\n\r\n%s" % (len(body), body))
            wait_for(lambda: state.batcher.queued == 2, "the request to be queued")
        metrics = state.metrics
        wait_for(lambda: metrics.requests.get(("/predict", 499)), "the server to see the client go")
        gate.open()
        assert first.result(LIMIT).status_code == 200
        wait_for(lambda: state.batcher.queued == 0, "the queue to empty")
    assert gate.calls == [1]  # the abandoned request never ran


def test_a_kept_alive_connection_answers_without_waiting_for_a_delayed_ack(classifier):
    """With Nagle's algorithm on, every answer after the first on a connection waited ~40 ms (`server.bind`)."""
    url, _ = classifier
    times = []
    with httpx.Client(timeout=LIMIT) as http:
        for _ in range(9):
            start = time.perf_counter()
            assert http.get(url + "/health").status_code == 200
            times.append(time.perf_counter() - start)
    assert statistics.median(times[1:]) < 0.02


def test_api_key_guards_every_endpoint_but_the_page_and_health(models):
    with running(models["clf"], api_key="s3cret") as (url, _):
        assert post(url, "/predict", {"inputs": "good"}).status_code == 401
        assert httpx.get(url + "/info", timeout=LIMIT).status_code == 401
        r = post(url, "/predict", {"inputs": "good"}, headers={"authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert post(url, "/predict", {"inputs": "good"}, headers={"authorization": "Bearer s3cret"}).status_code == 200
        assert httpx.get(url + "/health", timeout=LIMIT).status_code == 200
        assert httpx.get(url + "/", timeout=LIMIT).status_code == 200


def test_command_refuses_a_port_in_use_a_missing_model_and_a_missing_extra_in_one_line(models, capsys, monkeypatch):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert main(["serve", "--model", str(models["clf"]), "--port", str(port)]) == 2
    assert capsys.readouterr().err.strip().endswith(f"--port {port} is in use on 127.0.0.1: pick another (--port 0: "
                                                    "any free one)")
    assert main(["serve", "--model", str(models["clf"]), "--max-inputs", "10", "--max-queue", "5"]) == 2
    assert "--max-inputs 10 is above --max-queue 5" in capsys.readouterr().err
    assert main(["serve", "--model", str(models["clf"] / "nowhere")]) == 2
    assert "is not a model directory (no config.json)" in capsys.readouterr().err
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "fastapi" else real(name, *a))
    assert main(["serve", "--model", str(models["clf"])]) == 2
    assert capsys.readouterr().err == "error: bertforge serve needs fastapi: pip install 'bertforge[serve]'\n"


@pytest.mark.slow  # several seconds: full pretraining runs or a server process
def test_sigterm_finishes_the_accepted_requests_and_exits_0(models):
    proc = subprocess.Popen([sys.executable, "-m", "bertforge", "serve", "--model", str(models["clf"]), "--port", "0",
                             "--max-wait-ms", "2000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = proc.stdout.readline()  # blocks until the server is up (or the process died)
        assert "serving" in line, proc.stderr.read()
        url = line.split(" on ")[1].split()[0]
        in_flight = re.compile(r"^bertforge_requests_in_flight (\d+)$", re.M)
        answered = re.compile(r"^bertforge_requests_total\{[^}]*\} (\d+)$", re.M)
        made = [0]  # the requests this test has made to the server: its /predict posts and its looks at /metrics

        def accepted(fs) -> bool:
            """Every request of the round answered, or every request made so far inside the server, answered or in
            flight (one not yet connected would be refused once the signal closes the socket). The server counts an
            answer and the end of its flight in one step, so its answered + in flight is the requests that reached
            it; comparing its in flight with the futures not done was not enough: an answer the client already held,
            not yet counted by the server, stood in for a request still to connect (a clean clone's `.ci/run`)."""
            if all(f.done() for f in fs):
                return True
            made[0] += 1  # this look
            text = httpx.get(url + "/metrics", timeout=LIMIT).text
            flying = in_flight.search(text)
            return flying is not None and int(flying[1]) + sum(map(int, answered.findall(text))) == made[0]

        sent, answers = [], []
        with ThreadPoolExecutor(4) as pool:
            # a round of four until some are unanswered when we look: on a loaded CPU (the suite's other worker) the
            # four can reach the server one by one, each answered at once, round after round (5 rounds were not
            # enough once in a clean clone's `.ci/run`)
            for _ in range(30):
                futures = [pool.submit(post, url, "/predict", {"inputs": t}) for t in SENTENCES[:4]]
                sent += SENTENCES[:4]
                made[0] += 4
                # the first runs at once; those arriving while it runs wait 2 s in the batcher for more
                wait_for(lambda fs=futures: accepted(fs), "the requests to be accepted")
                if not all(f.done() for f in futures):
                    break
                answers += [f.result(0) for f in futures]
            else:
                pytest.fail("every round of four was answered before we could look")
            proc.send_signal(signal.SIGTERM)  # some of the last four still unanswered
            answers += [f.result(LIMIT) for f in futures]
        assert [a.status_code for a in answers] == [200] * len(sent)
        close([a.json() for a in answers], predict_records(models["clf"], [{"text": t} for t in sent]))
        assert proc.wait(LIMIT) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health", timeout=LIMIT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(LIMIT)


def test_a_full_queue_refuses_before_reading_the_body(models):
    """The refusal a burst meets costs the server no body read and no parsing: one sent with its headers and no
    body yet is answered at once (reading the body first would wait for bytes that never come)."""
    with (running(models["clf"], max_queue=1, max_inputs=1) as (url, state), Gate(state) as gate,
          ThreadPoolExecutor(2) as pool):
        first = pool.submit(post, url, "/predict", {"inputs": "first"})
        wait_for(gate.entered.is_set, "the engine to take the first request")
        queued = pool.submit(post, url, "/predict", {"inputs": "second"})
        wait_for(lambda: state.batcher.queued == 1, "the second request to be queued")
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=LIMIT) as raw:
            raw.sendall(b"POST /predict HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                        b"content-length: 1000\r\n\r\n")
            answer = b""
            while b"inputs waiting" not in answer and (part := raw.recv(65536)):  # headers and body may come apart
                answer += part
            answer = answer.decode()
        assert answer.startswith("HTTP/1.1 503 ") and "retry-after: 1" in answer.lower(), answer
        assert "the queue is full (1 inputs waiting)" in answer
        gate.open()
        assert [f.result(LIMIT).status_code for f in (first, queued)] == [200, 200]


def test_the_command_freezes_the_loaded_heap_before_it_says_it_serves(models, monkeypatch, capsys):
    """What is alive once the model is loaded is out of the cyclic collector's reach when serving starts: a full
    collection over it held a burst's refusals back by about 90 ms (server.py). The freeze's own collection comes
    before the line saying the server serves: a burst sent on that line waited it out (~150 ms of refusals)."""
    import builtins
    import gc

    import bertforge.serve.server as server_module

    seen = {}

    class Server:
        def __init__(self, real):
            self.config = real.config

        def run(self, sockets):
            seen["frozen"] = gc.get_freeze_count()
            sockets[0].close()

    real_make = server_module.make_server

    def make_server(options):
        server, sock = real_make(options)
        return Server(server), sock

    def said(*args, **kw):
        if "serving" in str(args[0]):
            seen["frozen when said"] = gc.get_freeze_count()
        builtins.print(*args, **kw)

    monkeypatch.setattr(server_module, "make_server", make_server)
    monkeypatch.setattr(server_module, "print", said, raising=False)
    gc.unfreeze()
    try:
        assert main(["serve", "--model", str(models["clf"]), "--port", "0"]) == 0
    finally:
        gc.unfreeze()
    assert seen["frozen"] > 10_000  # the model's modules and the libraries' objects, not a handful
    assert seen["frozen when said"] > 10_000
    assert "serving" in capsys.readouterr().out


def test_the_gates_own_lane_answers_as_the_fastapi_routes(models):
    """The Gate answers the model endpoints itself (without FastAPI's routing): every body, good or bad, gets the
    same status and JSON from it as from the FastAPI app's routes."""
    import asyncio

    from bertforge.serve.app import create_app
    from bertforge.serve.model import ServedModel
    from bertforge.serve.options import ServeOptions

    gates_own = ("body: not valid UTF-8", "body: larger")  # refused before either reads the body
    cases = {"clf": [("/predict", b) for b, _, error in BAD if not error.startswith(gates_own)]
             + [("/predict", {"inputs": SENTENCES}), ("/predict", {"inputs": "good"}),
                ("/predict", b"[" * 5000 + b"]" * 5000), ("/embed", {"inputs": ["a", "b"], "pooling": "pooler"}),
                ("/embed", {"inputs": "a film", "pooling": "mean", "normalize": True})],
             "mlm": [("/fill-mask", {"inputs": MASKED, "top_k": 3}), ("/fill-mask", {"inputs": "no mask"}),
                     ("/fill-mask", {"inputs": "[MASK]", "top_k": 0}), ("/embed", {"inputs": "x", "pooling": "max"})]}

    async def answers(app, requests) -> list:
        out = []
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            for path, body in requests:
                content = body if isinstance(body, bytes) else json.dumps(body).encode()
                r = await client.post(path, content=content, headers={"content-type": "application/json"})
                out.append((path, r.status_code, r.json()))
        return out

    for kind, requests in cases.items():
        gate = create_app(ServedModel.load(models[kind]), ServeOptions(model=str(models[kind]), max_inputs=8))
        gate.state.batcher.start()
        try:
            lane, routes = asyncio.run(answers(gate, requests)), asyncio.run(answers(gate.app, requests))
        finally:
            gate.state.batcher.close(LIMIT)
        assert lane == routes
        assert {status for _, status, _ in lane} >= {200, 422}


def test_the_model_is_loaded_on_a_thread_that_ends_not_on_the_main_thread(models, monkeypatch):
    """Every thread that runs a parallel region keeps an OpenMP team; the main thread's, beside the engine worker's,
    made every engine call wake its threads from sleep (serve/server.py `loaded_apart`)."""
    from bertforge.serve import server as server_module
    from bertforge.serve.model import ServedModel
    from bertforge.serve.options import ServeOptions

    threads = []
    real_load = ServedModel.load

    def load(*args, **kwargs):
        threads.append(threading.current_thread())
        return real_load(*args, **kwargs)

    monkeypatch.setattr(ServedModel, "load", load)
    served = server_module.loaded_apart(ServeOptions(model=str(models["clf"])))
    assert served.endpoints == ["/predict", "/embed"]
    assert len(threads) == 1 and threads[0] is not threading.main_thread() and not threads[0].is_alive()
    with pytest.raises(BertforgeError, match="is not a model directory"):
        server_module.loaded_apart(ServeOptions(model=str(models["clf"] / "absent")))
