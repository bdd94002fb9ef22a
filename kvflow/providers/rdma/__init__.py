"""The rdma provider (libibverbs RC queue pairs over kvflow._verbs):
devices, memory registration, queue-pair setup through the control
connection, device health and QP repair (provider)."""
