"""Waiting queue of the scheduler: first come, first served.

Data flow: `Scheduler.add_request` appends new requests; a preempted request is put back at the
*front* (it was admitted before everything still waiting, and FCFS order must survive preemption);
`Scheduler.schedule` admits from the front while the step has budget.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator

from paphos.request import Request


class RequestQueue:
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        if not self._queue:
            raise IndexError("peek on an empty request queue")
        return self._queue[0]

    def pop(self) -> Request:
        if not self._queue:
            raise IndexError("pop from an empty request queue")
        return self._queue.popleft()

    def remove(self, req_ids: Iterable[str]) -> list[Request]:
        """Remove the requests with these ids (O(n), aborts are rare); returns those removed."""
        ids = set(req_ids)
        removed = [r for r in self._queue if r.request_id in ids]
        if removed:
            self._queue = deque(r for r in self._queue if r.request_id not in ids)
        return removed

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)
