"""Who is admitted next: interactive before bulk, and round robin between tenants within a class.

One tenant with 500 queued requests and another with one each get every other admission,
so the single request waits for at most one of the 500, not all of them.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from typing import Generic, Protocol, TypeVar

from sluice_inference_adapter import metrics
from sluice_inference_adapter.priority import Priority


class Queued(Protocol):
    @property
    def tenant(self) -> str: ...

    @property
    def priority(self) -> Priority: ...


T = TypeVar("T", bound=Queued)


class FairWaitingQueue(Generic[T]):
    def __init__(self, replica: str = "") -> None:
        self._replica = replica
        # Per class, tenants in round-robin order, each with its own FIFO.
        self._classes: dict[Priority, OrderedDict[str, deque[T]]] = {p: OrderedDict() for p in Priority}
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def count(self, priority: Priority) -> int:
        return sum(len(q) for q in self._classes[priority].values())

    def push(self, item: T) -> None:
        self._classes[item.priority].setdefault(item.tenant, deque()).append(item)
        self._count += 1
        self._report()

    def push_front(self, item: T) -> None:
        """Back at the head, its tenant first in its class: an item taken out that could not run."""
        tenants = self._classes[item.priority]
        tenants.setdefault(item.tenant, deque()).appendleft(item)
        tenants.move_to_end(item.tenant, last=False)
        self._count += 1
        self._report()

    def _report(self) -> None:
        for priority in Priority:
            metrics.WAITING.labels(priority=priority.name.lower(), replica=self._replica).set(self.count(priority))

    def peek(self) -> T | None:
        for tenants in self._classes.values():
            for queue in tenants.values():
                return queue[0]
        return None

    def pop(self) -> T | None:
        """The head of the first tenant in the highest non-empty class; that tenant goes to the back."""
        for tenants in self._classes.values():
            if not tenants:
                continue
            tenant, queue = next(iter(tenants.items()))
            item = queue.popleft()
            del tenants[tenant]
            if queue:
                tenants[tenant] = queue  # re-inserted at the end: the next tenant goes first
            self._count -= 1
            self._report()
            return item
        return None

    def remove_if(self, predicate: Callable[[T], bool]) -> list[T]:
        """Takes out every item the predicate selects (cancelled, expired) and returns them."""
        removed: list[T] = []
        for tenants in self._classes.values():
            for tenant in list(tenants):
                queue = tenants[tenant]
                kept = deque(item for item in queue if not predicate(item))
                removed.extend(item for item in queue if predicate(item))
                if kept:
                    tenants[tenant] = kept
                else:
                    del tenants[tenant]
        self._count -= len(removed)
        self._report()
        return removed

    def __iter__(self) -> Iterator[T]:
        for tenants in self._classes.values():
            for queue in tenants.values():
                yield from queue
