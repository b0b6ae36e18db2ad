"""A local word-level tokenizer (``tok0 .. tokN``) with a chat template, for gateway tests and
benchmarks: no model, no torch, nothing downloaded.

The chat template joins the messages' contents, each followed by a space, so a chat's token
ids are its messages' words in order; the vocabulary is the one
:func:`testsupport.tiny_model.build_tiny_llama` writes, and
:func:`add_chat_template` gives that model's tokenizer the same template (vLLM's OpenAI
server needs one for chat requests).
"""

from __future__ import annotations

import os

CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def build_tokenizer(path: str, vocab: int = 1024) -> str:
    """Write the tokenizer into ``path`` (created); returns ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: PLC0415
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415

    os.makedirs(path, exist_ok=True)
    words = {"<unk>": 0, "<s>": 1, "</s>": 2}
    words.update({f"tok{i}": i for i in range(3, vocab)})
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return path


def add_chat_template(path: str) -> str:
    """Give the tokenizer saved in ``path`` the chat template above (saved in place)."""
    from transformers import AutoTokenizer  # noqa: PLC0415

    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    return path
