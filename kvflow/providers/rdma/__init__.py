"""The rdma provider (libibverbs RC queue pairs over kvflow._verbs):
provider.py (RdmaProvider: devices, registration, QP setup through the
control connection, notifications), options.py (RdmaOptions and the
per-device choices), repair.py (probing and repairing QPs), health.py
(device events, removal and return)."""
