"""A request's prompt token ids, as a vLLM replica computes them.

The tokenizer is loaded from a local directory (``--tokenizer DIR``: the model's tokenizer
files, ``tokenizer.json`` and ``tokenizer_config.json`` with its chat template) with
``transformers.AutoTokenizer``, the class vLLM itself uses, so the template renders alike.

* ``/v1/chat/completions``: the chat template over ``messages`` (``add_generation_prompt``
  default true, ``continue_final_message``, ``tools``, ``chat_template_kwargs`` as the request
  gives them), rendered to text, then encoded with ``add_special_tokens`` (default false), as
  vLLM's OpenAI server does. Content given as a list of text parts is joined with newlines.
* ``/v1/completions``: ``prompt`` a string is encoded with special tokens (vLLM's default),
  a list of token ids is taken as is; a batch (a list of prompts) is routed by its first.
"""

from __future__ import annotations

from typing import Any


class PromptError(ValueError):
    """A request whose prompt cannot be read (answered 400)."""


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if not all(isinstance(t, str) for t in parts):
            raise PromptError("a text part's 'text' must be a string")
        return "\n".join(parts)
    raise PromptError("message content must be a string or a list of parts")


# chat_template_kwargs the gateway never passes on: a template of the client's own would run
# on the gateway's event loop (a few loops in 200 bytes stall every request; vLLM refuses
# request templates by default), and the others are the gateway's to set
_REFUSED_KWARGS = frozenset({"chat_template", "tokenize", "conversation", "messages", "tools", "documents",
                             "continue_final_message", "add_generation_prompt", "return_dict"})


class PromptTokenizer:
    """Prompt token ids of OpenAI requests (module docstring)."""

    def __init__(self, path: str) -> None:
        try:
            from transformers import AutoTokenizer  # noqa: PLC0415 - 2 s to import: only when used
        except ImportError as e:  # pragma: no cover
            raise RuntimeError("kvtier gateway needs transformers for --tokenizer (pip install "
                               "'kvtier[gateway]')") from e
        try:
            self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as e:
            raise RuntimeError(f"kvtier gateway: cannot load the tokenizer in {path}: {e}") from None

    def chat(self, body: dict[str, Any]) -> list[int]:
        text, add_special = self.chat_text(body)
        return self.encode(text, add_special)

    @staticmethod
    def check_chat(body: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """A chat request's messages (text parts joined) and template keyword arguments, checked
        without rendering anything; :class:`PromptError` names what is wrong."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise PromptError("'messages' must be a non-empty list")
        conv = []
        for m in messages:
            if not isinstance(m, dict) or "role" not in m:
                raise PromptError("each message needs a 'role'")
            content = m.get("content")
            conv.append(m if isinstance(content, str) else {**m, "content": _text(content)})
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise PromptError("'chat_template_kwargs' must be an object")
        refused = sorted(_REFUSED_KWARGS.intersection(kwargs))
        if refused:
            raise PromptError(f"chat_template_kwargs may not set {', '.join(refused)}")
        return conv, kwargs

    def chat_text(self, body: dict[str, Any]) -> tuple[str, bool]:
        """The rendered chat template, and whether the tokenizer adds its special tokens to it."""
        conv, kwargs = self.check_chat(body)
        cont = bool(body.get("continue_final_message", False))
        try:
            text = self.tok.apply_chat_template(
                conv, tools=body.get("tools"), tokenize=False, continue_final_message=cont,
                add_generation_prompt=bool(body.get("add_generation_prompt", not cont)), **kwargs)
        except Exception as e:  # noqa: BLE001 - jinja errors of many kinds: the replica answers them
            raise PromptError(f"chat template: {e}") from None
        return text, bool(body.get("add_special_tokens", False))

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=add_special_tokens))

    def completion(self, body: dict[str, Any]) -> list[int]:
        prompt = self.check_completion(body)
        if isinstance(prompt, str):
            return list(self.tok.encode(prompt, add_special_tokens=bool(body.get("add_special_tokens", True))))
        return prompt

    @staticmethod
    def check_completion(body: dict[str, Any]) -> str | list[int]:
        """The prompt a completion request is routed by (a batch: its first), checked."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch: routed by its first prompt
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list) and all(type(t) is int and 0 <= t < 1 << 31 for t in prompt):
            return prompt
        raise PromptError("'prompt' must be a string, a list of token ids, or a list of those")
