"""The rdma provider (libibverbs RC queue pairs over kvflow._verbs):
provider.py (RdmaProvider: devices, registration, QP setup through the
control connection, notifications), options.py (RdmaOptions and the
per-device choices), repair.py (probing and repairing QPs), health.py
(device events, removal and return), part.py (its part of the engine's
descriptor, registered with kvflow.control.descriptor here)."""
from kvflow.providers.rdma import part as _part  # noqa: F401 (registers the "rdma" descriptor part)
