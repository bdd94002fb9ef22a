"""Drop-in APIs of other transfer engines, backed by kvflow.

`kvflow.compat.mooncake.TransferEngine` speaks Mooncake Transfer Engine's
Python API (`mooncake.engine.TransferEngine`), so code written for Mooncake
(SGLang's and vLLM's connectors) can move its bytes with kvflow by changing
one import. Nothing here is imported by `import kvflow`.
"""
