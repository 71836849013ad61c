"""A light HTTP/1.1 load generator for the serving bench: one thread, one event loop, raw bytes on kept-alive
loopback connections, so the client takes as little of a small machine's CPU as it can (a pure-Python client
such as httpx costs about as much CPU per request as a small model's forward pass, and the client shares the
machine with the server it measures). Every exchange has a timeout, so a run always ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

TIMEOUT = 60.0


class Connection:
    """One kept-alive connection; `post` sends a request and reads its answer (status, body)."""

    def __init__(self, url: str):
        parts = urlsplit(url)
        self.host, self.port = parts.hostname, parts.port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        if self.writer is None:
            await self.open()
        head = (f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\n\r\n").encode()
        self.writer.write(head + body)
        return await asyncio.wait_for(self._answer(), TIMEOUT)

    async def _answer(self) -> tuple[int, bytes]:
        head = (await self.reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        status = int(head[0].split()[1])
        headers = dict(line.split(":", 1) for line in head[1:] if ":" in line)
        headers = {k.strip().lower(): v.strip().lower() for k, v in headers.items()}
        if headers.get("transfer-encoding") == "chunked":
            body = b""
            while size := int((await self.reader.readuntil(b"\r\n")).strip(), 16):
                body += (await self.reader.readexactly(size + 2))[:-2]
            await self.reader.readuntil(b"\r\n")
        else:
            body = await self.reader.readexactly(int(headers.get("content-length", 0)))
        if headers.get("connection") == "close":
            await self.close()
        return status, body

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(OSError):
                await self.writer.wait_closed()
            self.reader = self.writer = None


@contextlib.contextmanager
def gc_held() -> Iterator[None]:
    """The client's own cyclic garbage collector held off while it measures: the bench's process also holds the
    offline side's model and libraries, and a full collection over them in the middle of a burst took every answer
    behind it (the server freezes its heap for the same reason, `bertforge.serve.server`)."""
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.unfreeze()


async def closed_loop(url: str, path: str, bodies: list[bytes], clients: int, requests: int) -> dict:
    """`requests` POSTs of `bodies[n % len(bodies)]` from `clients` connections, each sending its next request when
    the last is answered: wall time, and per request its latency, status and answer."""
    latencies, statuses, answers = [0.0] * requests, [0] * requests, [b""] * requests
    counter = iter(range(requests))

    async def client() -> None:
        conn = Connection(url)
        try:
            for n in counter:  # shared: each request is sent once, by whichever client is free
                t0 = time.perf_counter()
                try:
                    statuses[n], answers[n] = await conn.post(path, bodies[n % len(bodies)])
                except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, ValueError):
                    statuses[n] = -1
                    await conn.close()
                latencies[n] = time.perf_counter() - t0
        finally:
            await conn.close()

    with gc_held():
        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
    return {"seconds": time.perf_counter() - t0, "latencies": latencies, "statuses": statuses, "answers": answers}


async def burst(url: str, path: str, bodies: list[bytes], count: int) -> list[tuple[int, float, bytes]]:
    """`count` connections opened first, then one request on each, all at once: per request its status, the
    time from its sending to its answer, and the answer."""
    conns = [Connection(url) for _ in range(count)]
    for start in range(0, count, 64):  # the listen backlog takes them in bounded waves
        await asyncio.gather(*(c.open() for c in conns[start:start + 64]))

    async def one(n: int) -> tuple[int, float, bytes]:
        t0 = time.perf_counter()
        try:
            status, answer = await conns[n].post(path, bodies[n % len(bodies)])
        except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, ValueError):
            status, answer = -1, b""
        return status, time.perf_counter() - t0, answer

    try:
        with gc_held():
            return await asyncio.gather(*(one(n) for n in range(count)))
    finally:
        await asyncio.gather(*(c.close() for c in conns))
