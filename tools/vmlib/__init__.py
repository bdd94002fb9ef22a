"""The parts of tools/rdma_vm.py (the script keeps running the VM, run_vm(),
and the command line). Stdlib only; imported with tools/ on sys.path, as
tools/rdma_vm.py puts it."""
