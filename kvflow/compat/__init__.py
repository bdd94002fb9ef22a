"""Drop-in APIs of other transfer engines, backed by kvflow.

`kvflow.compat.mooncake.TransferEngine` speaks Mooncake Transfer Engine's
Python API (`mooncake.engine.TransferEngine`), so code written for Mooncake
(SGLang's and vLLM's connectors) can move its bytes with kvflow by changing
one import. `kvflow.compat.nixl` is NIXL's Python API (`nixl_agent`) on
kvflow; `kvflow.compat.sglang` registers kvflow as SGLang's "kvflow"
transfer backend. Nothing here is imported by `import kvflow`.
"""
