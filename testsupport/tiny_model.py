"""A tiny Llama with random weights and a local tokenizer, for engine tests and benchmarks.

Nothing is downloaded: the model is built from a ``transformers`` config (random weights,
fixed seed, saved with ``save_pretrained``) and the tokenizer is a ``tokenizers`` WordLevel
vocabulary (``tok0 .. tokN``) saved beside it as a ``PreTrainedTokenizerFast``. The directory
loads in vLLM (``LLM(model=path)``) and in ``transformers``.

Needs ``torch``, ``transformers`` and ``tokenizers`` (all come with vLLM); kvtier itself
does not.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class TinyLlama:
    """The shape of the model :func:`build_tiny_llama` writes."""

    layers: int = 4
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 1024
    intermediate: int = 512
    max_positions: int = 4096
    init_std: float = 0.1   # larger than usual: random weights whose outputs depend on the KV
    seed: int = 0
    dtype: str = "bfloat16"


def build_tiny_llama(path: str, spec: TinyLlama = TinyLlama()) -> str:
    """Write the model and tokenizer into ``path`` (created); returns ``path``. Skips the work
    when ``path`` already holds a model of the same ``spec``."""
    marker = os.path.join(path, "kvtier-tiny.json")
    if os.path.exists(marker):
        with open(marker) as fh:
            if json.load(fh) == asdict(spec):
                return path
    import torch  # noqa: PLC0415 - optional dependencies, imported on use
    from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: PLC0415
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: PLC0415

    os.makedirs(path, exist_ok=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"tok{i}": i for i in range(3, spec.vocab)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)

    cfg = LlamaConfig(vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
                      num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
                      num_key_value_heads=spec.kv_heads, max_position_embeddings=spec.max_positions,
                      initializer_range=spec.init_std, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                      tie_word_embeddings=False, dtype=spec.dtype)
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(cfg).to(getattr(torch, spec.dtype))
    model.save_pretrained(path)
    with open(marker, "w") as fh:
        json.dump(asdict(spec), fh)
    return path


if __name__ == "__main__":
    import sys

    print(build_tiny_llama(sys.argv[1] if len(sys.argv) > 1 else "/tmp/kvtier-tiny-llama"))
