"""The server's metrics in Prometheus' text format (version 0.0.4), written here rather than with a client
library: a few counters and two histograms are all `/metrics` shows, and the extra stays two packages."""

from __future__ import annotations

import bisect
import threading
from collections import defaultdict
from collections.abc import Callable, Sequence

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)  # seconds
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)  # inputs per engine call


class Histogram:
    def __init__(self, buckets: Sequence[float]):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # the last: above every bucket
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    def lines(self, name: str, labels: str = "") -> list[str]:
        sep = "," if labels else ""
        out, total = [], 0
        for bound, count in zip((*self.buckets, "+Inf"), self.counts, strict=True):
            total += count
            out.append(f'{name}_bucket{{{labels}{sep}le="{bound}"}} {total}')
        suffix = f"{{{labels}}}" if labels else ""
        return [*out, f"{name}_sum{suffix} {self.sum:.6f}", f"{name}_count{suffix} {total}"]


class Metrics:
    """Requests by endpoint and status, their latency by endpoint, inputs per engine call, the queue's depth (read
    when scraped, from `queue_depth`)."""

    def __init__(self, queue_depth: Callable[[], int]):
        self._lock = threading.Lock()
        self._queue_depth = queue_depth
        self.requests: defaultdict[tuple[str, int], int] = defaultdict(int)
        self.in_flight = 0  # requests arrived and not yet answered
        self.latency: dict[str, Histogram] = {}
        self.batch_inputs = Histogram(BATCH_BUCKETS)
        self.batch_requests = Histogram(BATCH_BUCKETS)

    def arrived(self) -> None:
        with self._lock:
            self.in_flight += 1

    def request(self, endpoint: str, status: int, seconds: float) -> None:
        """A request answered (or whose client went away)."""
        with self._lock:
            self.in_flight -= 1
            self.requests[endpoint, status] += 1
            self.latency.setdefault(endpoint, Histogram(LATENCY_BUCKETS)).observe(seconds)

    def batch(self, requests: int, inputs: int) -> None:
        with self._lock:
            self.batch_requests.observe(requests)
            self.batch_inputs.observe(inputs)

    def render(self) -> str:
        with self._lock:
            lines = ["# HELP bertforge_requests_total HTTP requests answered, by endpoint and status code.",
                     "# TYPE bertforge_requests_total counter"]
            lines += [f'bertforge_requests_total{{endpoint="{e}",code="{c}"}} {n}'
                      for (e, c), n in sorted(self.requests.items())]
            lines += ["# HELP bertforge_request_seconds Time from a request's arrival to its answer, by endpoint.",
                      "# TYPE bertforge_request_seconds histogram"]
            for endpoint, hist in sorted(self.latency.items()):
                lines += hist.lines("bertforge_request_seconds", f'endpoint="{endpoint}"')
            lines += ["# HELP bertforge_batch_inputs Inputs run together in one engine call.",
                      "# TYPE bertforge_batch_inputs histogram", *self.batch_inputs.lines("bertforge_batch_inputs"),
                      "# HELP bertforge_batch_requests Requests run together in one engine call.",
                      "# TYPE bertforge_batch_requests histogram",
                      *self.batch_requests.lines("bertforge_batch_requests"),
                      "# HELP bertforge_requests_in_flight Requests arrived and not yet answered, this one included.",
                      "# TYPE bertforge_requests_in_flight gauge", f"bertforge_requests_in_flight {self.in_flight}",
                      "# HELP bertforge_queue_inputs Inputs waiting for the engine.",
                      "# TYPE bertforge_queue_inputs gauge", f"bertforge_queue_inputs {self._queue_depth()}"]
        return "\n".join(lines) + "\n"
