"""A directory for PYTHONPATH that registers kvflow with SGLang in every
process SGLang starts (its schedulers run in processes of their own):

    PYTHONPATH=$(python -m kvflow.compat.sglang.shim) \
        python -m sglang.launch_server ... --disaggregation-transfer-backend kvflow

It holds a `sitecustomize` that waits for SGLang's disaggregation utils to be
imported and then calls kvflow.compat.sglang.install(): a process that never
imports SGLang pays nothing. (A `sitecustomize` of your own elsewhere on the
path is shadowed by this one: call install() from yours instead.)"""
from __future__ import annotations

import pathlib


def shim_path() -> str:
    return str(pathlib.Path(__file__).parent / "root")
