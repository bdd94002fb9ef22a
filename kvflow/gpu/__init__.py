"""GPU helpers with no engine knowledge: copy engines (copy.py: CUDA
streams, or host memmove for tests), the put proxy (proxy.py: the CPU side
of GPU-initiated puts) and the IBGDA launcher (ibgda.py). They build on
kvflow._cuda (the driver and the kernels) and kvflow.errors; they never
import engine/ or paths/ (tests/test_layers.py), and nothing here imports
CUDA until a CUDA object is made."""
