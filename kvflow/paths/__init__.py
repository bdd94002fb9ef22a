"""The ways a batch travels besides one native channel, between engine/
(whose router, kvflow.engine.router, picks one per batch) and providers/
(whose host-memory channels carry every leg):

- slots.py: bounded pools of bounce buffers, the staging pipeline, the one
  check of a request's pieces against a slot; lease.py: slots an engine
  lends its peers (Inbox) and the borrowing side (Lease);
- staged.py: GPU memory over host providers, through staging slots on both
  sides; ipc.py: one direct copy where the peer's memory is addressable
  here (the same process; CUDA IPC on one host);
- relay/: the PXN relay (group, sender, member, lanes, device lanes).

A path gets a PathContext (base.py), never the Engine or the Peer class:
nothing here imports engine/ (tests/test_layers.py)."""
