"""Writes a tiny random-weight Llama and its tokenizer into a folder, for the vLLM tests.

Run with the vLLM venv's python (it has torch and transformers):
    python tests/_vllm_model.py OUT_DIR

Nothing is downloaded: the tokenizer is a word-level one over the words w0..w{N-1}
(whitespace-split), the model a 2-layer Llama (hidden 128, 2 heads of 64, 2 KV heads)
with weights drawn from a seeded normal (std 0.5, so greedy decoding has clear winners
and the same tokens come out of any run on any instance). Prompts for it are
strings of those words: tests/_vllm.py's prompt().
"""
from __future__ import annotations

import json
import sys

VOCAB_WORDS = 1000
SEED = 1234


def main(out: str, layers: int = 2, hidden: int = 128, heads: int = 2, kv_heads: int = 2,
         intermediate: int = 256, max_positions: int = 2048) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for i in range(VOCAB_WORDS):
        vocab[f"w{i}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with single spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    fast.save_pretrained(out)

    torch.manual_seed(SEED)
    cfg = LlamaConfig(vocab_size=len(vocab), hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=max_positions, bos_token_id=1, eos_token_id=2,
                      torch_dtype="float32")
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    model.save_pretrained(out)
    # Greedy runs stop only at max_tokens: no token ends a sequence early.
    with open(f"{out}/generation_config.json", "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2}, f)
    print(json.dumps({"vocab": len(vocab), "layers": layers, "kv_heads": kv_heads, "head_dim": hidden // heads}))


if __name__ == "__main__":
    # OUT_DIR [key=value ...]: a bigger model for benchmarks (tools/router_bench.py), e.g. layers=4 hidden=256
    main(sys.argv[1], **{k: int(v) for k, v in (a.split("=", 1) for a in sys.argv[2:])})
