"""Host topology: NICs (RDMA devices and netdevs), NUMA nodes, GPUs and the
PCI paths between them; which NICs should serve a memory location; the
preference an engine publishes to its peers; and how two ends pair rails.

Discovery reads sysfs (and /proc), never a device: it costs a few hundred
small file reads and works without libibverbs or a GPU driver. A JSON file
(`Topology.load`, or the environment variable KVFLOW_TOPOLOGY) overrides
what discovery found, for hosts whose sysfs lies (VMs, containers) or
whose operators want fixed rails.

Memory locations are strings: "cpu" (host memory, no particular node),
"cpu:N" (host memory on NUMA node N), "cuda:N" (GPU N).

model: the types; schema: topology files; discover: sysfs and /proc;
routing: rail pairing and routes.
"""
from kvflow.topology.discover import cached_host_topology, discover, host_topology, live_addresses
from kvflow.topology.model import (TOPOLOGY_ENV, Gid, Gpu, Nic, NicKind, NumaNode, RdmaPort, Topology,
                                   gid_text, ib_mtu, parse_location)
from kvflow.topology.routing import Route, match_rails, on_subnet, pair_tcp_rails, rail_order, route_to

__all__ = [
    "TOPOLOGY_ENV",
    "Gid",
    "Gpu",
    "Nic",
    "NicKind",
    "NumaNode",
    "RdmaPort",
    "Route",
    "Topology",
    "cached_host_topology",
    "discover",
    "gid_text",
    "host_topology",
    "ib_mtu",
    "live_addresses",
    "match_rails",
    "on_subnet",
    "pair_tcp_rails",
    "parse_location",
    "rail_order",
    "route_to",
]
