"""kvflow's connector for inference servers, shaped like SGLang's
disaggregation connector (sglang/srt/disaggregation/base/conn.py).

    args = KVArgs(engine_rank=0, kv_data_ptrs=..., kv_data_lens=..., kv_item_lens=...,
                  aux_data_ptrs=..., aux_data_lens=..., aux_item_lens=..., page_size=16)
    prefill = KVManager(args, DisaggregationMode.PREFILL, bootstrap_addr="10.0.0.1:8998")
    sender = KVSender(prefill, "10.0.0.1:8998", room)
    sender.init(num_pages, aux_index); sender.send_layer(i, pages) ...; sender.finish()

    decode = KVManager(args, DisaggregationMode.DECODE)
    receiver = KVReceiver(decode, "10.0.0.1:8998", room); receiver.init(prefill_dp_rank=0)
    receiver.send_metadata(decode_pages, aux_index)
    await receiver.wait()   # or poll() == KVPoll.Success

aiohttp is needed for the bootstrap server and its client only.
"""
from kvflow.connector.bootstrap import BootstrapServer
from kvflow.connector.manager import KVManager
from kvflow.connector.receiver import KVReceiver
from kvflow.connector.sender import KVSender
from kvflow.connector.types import DisaggregationMode, KVArgs, KVPoll, KVTransferError, KVTransferMetric

__all__ = ["BootstrapServer", "DisaggregationMode", "KVArgs", "KVManager", "KVPoll", "KVReceiver",
           "KVSender", "KVTransferError", "KVTransferMetric"]
