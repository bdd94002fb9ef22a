"""A relay member's device lanes (issue 21): the data of its lane slots
(lanes.py) in GPU memory, so that a sender whose batch lies in
its GPU's memory copies each slot's worth there with the copy engine
(over NVLink, through CUDA IPC) instead of bouncing it through host memory,
and the member forwards it from there.

The lane protocol stays the host lanes' (tickets, credits, the request in
the segment's meta area, statuses, collect); only where the data lies and
who rings the doorbell change:

- The member (`DeviceLaneArea`) allocates one device slot per segment slot
  (cuMemAlloc; slot i of the segment's lane-major count at base + i ×
  slot_bytes). It registers them with its engine as GPU memory peers may
  not touch (no access), so that its forward of a slot goes as any write
  from its GPU memory does. It publishes their IPC handle, its GPU's UUID
  and their size in its relay record.
- A sender (`DeviceLaneFiller`, one per member) opens them once
  (cuIpcOpenMemHandle; in the member's own process, the address as it is)
  and maps the segment's control words for its GPU (cuMemHostRegister).
  Per slot, once it holds the credit, it:
  1. publishes the request (Lanes.publish: no doorbell);
  2. queues on its stream the copies of the pieces into the device slot;
  3. queues cuStreamWriteValue64(ticket + 1) on the slot's doorbell word.
     Its default flags fence system-wide before the write, so a member
     that reads the doorbell (acquire) sees the copied bytes;
  4. queues cuLaunchHostFunc(RING_FN, bell), which wakes the member;
  5. records an event, which tells it a copy that failed.
  The stream runs the slots in order: the copy of slot k + 1 runs while
  the member posts slot k.
- A copy that fails, or a failure while queueing, fails the write with
  CudaError. The slot is then published empty from the CPU, after the
  stream is drained, so that its lane goes on.

Not run yet on a GPU (no machine here has one): `tools/gpu_check.sh`
runs it (tests/test_cuda.py, tools/gpu_relay.py).
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import uuid

from kvflow._lanes import RING_FN, LaneError, Lanes
from kvflow.errors import CudaError, KVFlowError

__all__ = ["DeviceLaneArea", "DeviceLaneFiller", "close_control", "map_control"]

log = logging.getLogger("kvflow")

# names this process in a member's record: a sender in the member's own
# process uses the raw address (a pid could match across PID namespaces)
PROCESS = uuid.uuid4().hex


class DeviceLaneArea:
    """A member's device slots, the shape of its segment's slots, on
    `device`; `register(addr, nbytes, name)` registers them with its
    engine (a GPU region without remote access), `deregister(region)`
    removes it."""

    def __init__(self, seg: Lanes, device: int, register: Callable[[int, int, str], Any],
                 deregister: Callable[[Any], None]) -> None:
        from kvflow._cuda import driver as drv
        self.device = device
        self.slot_bytes = seg.slot_bytes
        self._deregister = deregister
        self._mem = drv.DeviceMemory(seg.lanes * seg.slots * seg.slot_bytes, device)
        try:
            if not drv.stream_mem_ops(device):
                raise CudaError(f"cuda:{device} takes no 64-bit stream memory operations (the doorbell)")
            self._region = register(self._mem.addr, self._mem.size, "kvflow.relay.device-lanes")
            self.record = {"ipc": drv.ipc_handle(self._mem.addr, device).hex(),
                           "uuid": drv.device_uuid(device).hex(), "addr": self._mem.addr, "bytes": self._mem.size,
                           "process": PROCESS}
        except BaseException:
            self._mem.close()
            raise

    def slot_addr(self, seg: Lanes, lane: int, ticket: int) -> int:
        return self._mem.addr + seg.slot_index(lane, ticket) * self.slot_bytes

    def free(self, deregister: bool = True) -> None:
        """After the engine's core and copies stopped (nothing reads the
        slots any more)."""
        if deregister:
            try:
                self._deregister(self._region)
            except KVFlowError:
                pass
        try:
            self._mem.close()
        except CudaError as e:
            log.warning("kvflow relay: freeing the device lanes: %s", e)


def map_control(seg: Lanes, device: int) -> Any:
    """The segment's control words mapped for the GPUs (cuMemHostRegister,
    portable: one mapping serves every GPU of this process; the same range
    cannot be registered twice)."""
    from kvflow._cuda import driver as drv
    return drv.HostMapping(seg.base_addr, seg.control_bytes, device)


class DeviceLaneFiller:
    """A sender's way into one member's device lanes from GPU `device` (the
    GPU its batches are on): their mapping here, a stream of its own, and
    `control`, the segment's control words mapped for the GPUs
    (map_control; its owner closes it after the fillers)."""

    def __init__(self, seg: Lanes, record: dict[str, Any], device: int, control: Any) -> None:
        from kvflow._cuda import driver as drv
        self._drv = drv
        self.device = device
        size = int(record["bytes"])
        if size < seg.lanes * seg.slots * seg.slot_bytes:
            raise CudaError(f"device lanes of {size} bytes for a segment of {seg.lanes} x {seg.slots} slots")
        if not drv.stream_mem_ops(device):
            raise CudaError(f"cuda:{device} takes no 64-bit stream memory operations (the doorbell)")
        if drv.device_of_uuid(bytes.fromhex(record["uuid"])) is None:
            raise CudaError(f"the member's GPU {record['uuid']} is not visible here")
        self._opened = 0
        if record.get("process") == PROCESS:    # IPC handles do not open in the process that made them
            self.base = int(record["addr"])
        else:
            self.base = self._opened = drv.ipc_open(bytes.fromhex(record["ipc"]), device)
        self._map = control
        self._stream: Any = None
        self._bells: Any = None
        try:
            self._stream = drv.Stream(device)
            self._bells = drv.Stream(device)    # the bell's host functions: never in the copies' way
        except BaseException:
            self.close(seg)
            raise

    def fill(self, seg: Lanes, lane: int, ticket: int, pieces: list[tuple[int, int, int]], request: bytes) -> Any:
        """Publishes ticket's request and queues its copies ((slot offset,
        device source, nbytes) pieces), doorbell and bell; returns the
        event behind them. Raises CudaError once the slot is published empty
        (the stream drained first), so the lane goes on."""
        drv = self._drv
        if self._stream is None or self._bells is None:
            raise LaneError("the device lanes' filler is closed")      # before anything is published
        seg.publish(lane, ticket, request)
        event: Any = None
        try:
            dst = self.base + seg.slot_index(lane, ticket) * seg.slot_bytes
            doorbell = self._map.device_addr + (seg.ready_addr(lane, ticket) - seg.base_addr)
            event = drv.Event(self.device)
            with drv.on_device(self.device):
                for off, src, n in pieces:
                    drv.copy_async(dst + off, src, n, self._stream)
                drv.write_value64(self._stream, doorbell, ticket + 1)
            event.record(self._stream)
            # the bell on a stream of its own, behind the doorbell: a host
            # function blocks the work queued after it on its stream, and
            # the next slot's copy must not wait for the driver's callback
            with drv.on_device(self.device):
                drv.stream_wait_event(self._bells, event)
                drv.launch_host_func(self._bells, RING_FN, seg.bell_addr)
        except BaseException as e:
            if event is not None:
                _quietly(seg, "event", event.close)
            self.give_up(seg, lane, ticket)
            if isinstance(e, CudaError):
                raise
            raise CudaError(f"queueing a relayed slot on cuda:{self.device}: {e}") from e
        return event

    def give_up(self, seg: Lanes, lane: int, ticket: int) -> None:
        """Ticket's slot published empty from the CPU, once the stream has
        run what it queued: the member finishes it without a forward (or
        forwarded it already, if the doorbell was written first: the same
        bytes, and the empty request is then never read)."""
        try:
            self.drain()
        except CudaError:
            pass
        seg.fill(lane, ticket, [], [], [], b"")

    def drain(self) -> None:
        """Returns once the stream has run everything queued on it."""
        with self._drv.on_device(self.device):
            self._drv.check(self._drv.driver().cuStreamSynchronize(self._stream.handle), "cuStreamSynchronize")

    def close(self, seg: Lanes) -> None:
        """After the last ticket was collected: the stream drained and
        closed, the device lanes unmapped (the control words are the
        owner's)."""
        drv = self._drv
        stream, bells, opened = self._stream, self._bells, self._opened
        if stream is not None:
            _quietly(seg, "copies", self.drain)
            _quietly(seg, "stream", stream.close)
        if bells is not None:
            _quietly(seg, "bells", lambda: drv.check(drv.driver().cuStreamSynchronize(bells.handle),
                                                     "cuStreamSynchronize"))
            _quietly(seg, "bell stream", bells.close)
        if opened:
            _quietly(seg, "device lanes", lambda: drv.ipc_close(opened, self.device))
        self._stream = self._bells = None
        self._opened = 0


def close_control(seg: Lanes, control: Any) -> None:
    _quietly(seg, "control words", control.close)


def _quietly(seg: Lanes, what: str, undo: Callable[[], Any]) -> None:
    try:
        undo()
    except CudaError as e:
        log.warning("kvflow relay: closing the %s of %s: %s", what, seg.name, e)
