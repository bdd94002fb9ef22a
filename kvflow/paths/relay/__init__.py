"""The PXN relay ("stay", and "pass" below): a write whose destination sits on
another rail than this engine's goes through the member of this node's
relay group that owns that rail, which posts it on its own NIC, so that
every flow is rail-aligned and nothing crosses the spine (issue 21).

A node's engines form a relay group (`Engine(relay=RelayGroup(name, rank,
rail))`). Each member publishes itself (rank, rail, the address its group
reaches it at) as one file in a directory the node's processes share
(default /dev/shm/kvflow-relay-<name>/), removed at close; a file whose
process is gone is ignored. Engines put their group and rail in their
descriptor, so a sender knows a destination's rail.

The hop inside the node goes through the member's shared-memory lanes
(lanes.py): the sender copies a slot's worth of the batch into
its lane, rings the slot's doorbell, and the member writes the slot to the
destination, which checks the ranges against its own regions as it does
for any write; the member finishes the ticket when the bytes have landed
there, and the sender's write completes once it collected its last ticket,
so a notification after it finds the data in place. Several slots are in
flight at once: while one is on the member's NIC the next is being copied.

Where there is no lane (`RelayGroup(lanes=False)`, no free lane, no shared
memory) the hop reuses the inbox machinery (kvflow.paths.lease): the
member lends slots of its "relay" inbox, the sender writes a slot's worth
into one over the provider that joins them (cross-memory attach on one
host) and asks the member to forward it (`relay_forward`: the
destination's address and, per piece, the slot offset, the remote address
and the length), and the member answers once it landed.

On the receive side ("pass", `RelayGroup(side="receive")`) the hop runs
the other way round, over the network, by the inbox path: the sender
writes over its own rail into the inbox of the destination node's member
on that rail (the destination's descriptor lists its node's members), and
that member copies the slot to the destination inside its node.

A member that is lost while a write goes through it (its process died,
its segment retired, its connection dropped) does not fail the write: the
parts that had not come back from it are written directly to the
destination (`rerouted_bytes`); a part it may have forwarded already is
written again, the same bytes to the same place. Later writes go directly
while the group lists no live member on that rail. A refusal by the
destination itself is not rerouted: it fails the write as any refusal does.

GPU memory: a member with `RelayGroup(device=N)` also has device lanes
(device_lanes.py), the data of its lane slots in GPU N's
memory. A sender whose batch lies in GPU memory copies each slot's worth
there with its copy engine (CUDA IPC) and its stream writes the slot's
doorbell after the copy (cuStreamWriteValue64); the member forwards it
from its GPU memory as any write from there. A GPU batch toward a member
without device lanes (or whose lanes our GPU cannot reach) takes the
inbox path, which stages it through host memory; a GPU batch written
directly (no member, one lost) is staged as any other. Host-memory
batches may land in the destination's GPU memory either way: the member
writes them there as it writes any. The device path has not run on a GPU
yet (tools/gpu_check.sh runs it).

The package's rooms: group.py (RelayGroup, the group's folder, Relay: one
engine's membership, composing the two roles), sender.py (role A: this
engine's relayed writes), member.py (roles B and C: the inbox and lanes
the others write into, and the forwards it posts), lanes.py and
device_lanes.py (the shared-memory hop). The engine's router
(kvflow.engine.router) sends a write here; a relay gets a PathContext
(kvflow.paths.base), never the Engine.
"""
from kvflow.paths.relay.group import INBOX, RELAY_SLOT, RELAY_SLOTS, Relay, RelayGroup

__all__ = ["INBOX", "Relay", "RelayGroup", "RELAY_SLOT", "RELAY_SLOTS"]
