"""Slots of the recurrent-state pool (``LinearState`` layers): one per running request.

Host side only. A request takes a slot when it is admitted (with its first pages) and gives it
back with them: on finish, abort, and recompute preemption (the state is rebuilt from the
prompt). The device pool holds the slot's arrays; a row starting at position 0 reads zeros
whatever the slot held, so a slot needs no clearing between owners.
"""
from __future__ import annotations


class StateSlots:
    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"the state pool needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out the lowest
        self._owner: dict[int, str] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def allocate(self, request_id: str) -> int:
        if not self._free:
            raise RuntimeError("no free state slot")
        slot = self._free.pop()
        self._owner[slot] = request_id
        return slot

    def free(self, slot: int) -> None:
        if self._owner.pop(slot, None) is None:
            raise RuntimeError(f"state slot {slot} freed but not in use")
        self._free.append(slot)

    def owners(self) -> dict[int, str]:
        return dict(self._owner)
