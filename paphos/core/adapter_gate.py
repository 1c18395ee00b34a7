"""Which waiting requests may start this step given `--max-loras` device slots for adapters.

Data flow: `Scheduler.schedule()` builds one `AdapterGate` per step from the running requests and
asks it, in queue order, whether each waiting request may be admitted. Invariant it keeps: the
running requests use at most `max_loras` distinct adapters, so every step (a subset of the running
requests) fits the model runner's slots and the runner never has to refuse or stall a request.

Fairness: a request whose adapter has no free slot is passed over, and the requests behind it may
start when their adapter is already running (or they use none), so one cold adapter does not stall
everyone. To keep that from starving the passed-over request, one running adapter is *drained*:
while a request waits for a slot, no further request of the drained adapter starts, so its running
requests finish, its slot frees, and the waiting request takes it. The drained adapter is the one
with the fewest running requests, chosen once and kept until the wait ends.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from paphos.request import Request


class AdapterGate:
    def __init__(self, max_loras: int, running: Iterable[Request], draining: int | None) -> None:
        self.max_loras = max_loras
        self.active: Counter[int] = Counter(r.lora_id for r in running if r.lora_id)
        # Kept from the previous step while it is still running; chosen anew otherwise.
        self.draining = draining if draining in self.active else None
        # A request was passed over for want of a slot this step.
        self.blocked = False

    def admits(self, request: Request) -> bool:
        lora_id = request.lora_id
        if not lora_id:
            return True
        if lora_id in self.active:
            return not (self.blocked and lora_id == self.draining)
        if len(self.active) < self.max_loras:
            return True
        if not self.blocked:
            self.blocked = True
            if self.draining is None:
                self.draining = min(self.active, key=lambda a: (self.active[a], a))
        return False

    def admitted(self, request: Request) -> None:
        if request.lora_id:
            self.active[request.lora_id] += 1

    def next_draining(self, waiting: Iterable[Request]) -> int | None:
        """What the next step keeps draining: the same adapter while it runs and some waiting
        request needs a slot (whether or not this step's loop got as far as that request)."""
        if self.draining is None or not any(r.lora_id and r.lora_id not in self.active for r in waiting):
            return None
        return self.draining
