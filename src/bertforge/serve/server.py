"""Starting and stopping the server: the model loaded, the socket bound, uvicorn run until SIGINT or SIGTERM.

On SIGTERM uvicorn stops accepting connections, lets every accepted request finish (the engine's worker runs
what was queued), runs the app's shutdown (the worker stops) and returns; the process then exits 0.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import signal
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import uvicorn

from bertforge.errors import BertforgeError
from bertforge.serve.app import create_app
from bertforge.serve.model import ServedModel
from bertforge.serve.options import ServeOptions


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: a free one); a port in use is a BertforgeError naming --port.

    Made with its protocol named (IPPROTO_TCP), not 0 as `socket.create_server` makes it: asyncio turns Nagle's
    algorithm off (TCP_NODELAY) only on sockets that say they are TCP, and with it on, every answer after the
    first on a kept-alive connection waited about 40 ms for the client's delayed ACK (measured here: /health
    44 ms instead of 1)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             proto=socket.IPPROTO_TCP)[0]
    except socket.gaierror as e:
        raise BertforgeError(f"--host {host}: not an address of this machine ({e.strerror})") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart need not wait out TIME_WAIT
        sock.bind(address)
        sock.listen(1024)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise BertforgeError(f"--port {port} is in use on {host}: pick another (--port 0: any free one)") from None
        if e.errno == errno.EADDRNOTAVAIL:
            raise BertforgeError(f"--host {host}: not an address of this machine") from None
        raise
    return sock


def make_server(options: ServeOptions) -> tuple[uvicorn.Server, socket.socket]:
    """The model loaded and the app built into a uvicorn server, and its bound socket (not yet serving)."""
    served = loaded_apart(options)
    sock = bind(options.host, options.port)
    config = uvicorn.Config(create_app(served, options), log_level="info" if options.access_log else "warning",
                            access_log=options.access_log, lifespan="on", server_header=False)
    return uvicorn.Server(config), sock


def loaded_apart(options: ServeOptions) -> ServedModel:
    """The model loaded on a thread of its own, which ends when it is loaded: the main thread runs no parallel
    region. OpenMP (libgomp) keeps a team of threads for every thread that has run one, and where their threads
    outnumber the cores it lets an idle thread spin only briefly before it sleeps; with the main thread's team alive
    beside the engine worker's, every parallel region of an engine call woke its threads from sleep. One snippet to
    MiniLM-L6 on the worker thread, a 2-core Zen 4 EPYC: 8.4-9.8 ms fp32 and 3.7-4.5 ms int8 with the model loaded on
    the main thread, 5.9-6.5 and 2.5-2.8 with it loaded on a thread that ended (the same as on the main thread)."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="bertforge-serve-load") as pool:
        return pool.submit(ServedModel.load, options.model, options.engine()).result()


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


@contextlib.contextmanager
def _sigterm_exits_cleanly() -> Iterator[None]:
    """uvicorn raises the signal that stopped it again once it has shut down, for the handler it found; with
    the default one SIGTERM would then kill the process (status -15) after the clean shutdown."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def serve(options: ServeOptions) -> int:
    server, sock = make_server(options)
    _freeze_the_heap()  # before the line that says it serves: a client that starts on it is not kept waiting
    endpoints = ", ".join(server.config.app.state.served.endpoints)
    print(f"serving {options.model} ({endpoints}) on {url_of(sock)}  (page: /, API: /docs; Ctrl-C stops)",
          flush=True)
    with _sigterm_exits_cleanly():
        server.run(sockets=[sock])
    return 0


def _freeze_the_heap() -> None:
    """Everything alive once the model is loaded (the model's and the libraries' objects, about 270,000) moved out
    of the cyclic garbage collector's reach for the life of this process (`gc.freeze`): a full collection walked
    them all holding the GIL, and one that fell in a burst held every refusal behind it (median refusals of 140-157
    ms instead of 52-69 in 5 bursts of 16; with the freeze 52-80 ms in all 16, docs/benchmarks.md)."""
    gc.collect()
    gc.freeze()
