"""Text in and out of a served artifact: its tokenizer, its chat template, and text streamed token by token.

The chat template is rendered as transformers' `apply_chat_template` renders it (jinja2's sandbox with
`trim_blocks` and `lstrip_blocks`, `raise_exception`, the tokenizer's special tokens), and the rendered prompt
is tokenized without adding special tokens again (the template writes them), as vLLM does.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from tensorsmith.serve.errors import OpenAIError

REPLACEMENT = "\ufffd"  # what a decode of half a UTF-8 character ends in


class TextCodec:
    def __init__(self, tokenizer_dir: Path, chat_template: str | None = None) -> None:
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
        # a tokenizer.json may pad or cut every text to one length (sentence-transformers' do): requests are padded
        # here, and a text too long is refused, not cut
        self._tokenizer.no_padding()
        self._tokenizer.no_truncation()
        config_path = tokenizer_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self.special_tokens = {key: _token_text(config.get(key)) for key in ("bos_token", "eos_token", "pad_token")}
        self.chat_template = chat_template or _default_template(config.get("chat_template"))

    def encode(self, text: str, special: bool = True) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=special).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=True))

    def render_chat(self, messages: Sequence[Mapping[str, object]]) -> str:
        """The prompt for `messages` with the assistant's turn opened (add_generation_prompt)."""
        if self.chat_template is None:
            raise OpenAIError(
                400,
                "this model has no chat template (its tokenizer_config.json has no chat_template)",
                param="messages",
                hint="use /v1/completions, or serve with --chat-template FILE",
            )
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise OpenAIError(400, f"the chat template refused the messages: {message}", param="messages")

        environment = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        environment.globals["raise_exception"] = raise_exception
        try:
            template = environment.from_string(self.chat_template)
            return template.render(messages=messages, add_generation_prompt=True, **self.special_tokens)
        except jinja2.TemplateError as err:
            raise OpenAIError(400, f"the chat template failed on these messages: {err}", param="messages") from err


def _token_text(token: object) -> str:
    """A special token as tokenizer_config.json writes it: text, or transformers' AddedToken dict."""
    if isinstance(token, dict):
        return str(token.get("content", ""))
    return "" if token is None else str(token)


def _default_template(template: object) -> str | None:
    """tokenizer_config.json's chat_template: one template, or named ones of which "default" is used."""
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


class TextStream:
    """New tokens in, new text out: the whole completion is decoded each time (so tokens that merge, and
    characters split across tokens, come out right) and only what is settled is given; text that could begin a
    stop string is held back until it cannot."""

    def __init__(self, decode: Callable[[list[int]], str], stop: list[str]) -> None:
        self._decode = decode
        self._stop = [text for text in stop if text]
        self.tokens: list[int] = []
        self.text = ""  # given so far
        self.stopped = False

    def add(self, token: int) -> str:
        """The text settled by `token`; sets `stopped` when a stop string appears (the text ends before it)."""
        self.tokens.append(token)
        decoded = self._decode(self.tokens)
        if decoded.endswith(REPLACEMENT):
            return ""
        for stop in self._stop:
            found = decoded.find(stop, max(len(self.text) - len(stop), 0))
            if found >= 0:
                self.stopped = True
                return self._give(decoded[:found])
        held = max((_partial_stop(decoded, stop) for stop in self._stop), default=0)
        return self._give(decoded[: len(decoded) - held])

    def flush(self) -> str:
        """At the end: whatever was held back."""
        return "" if self.stopped else self._give(self._decode(self.tokens))

    def _give(self, upto: str) -> str:
        new = upto[len(self.text) :] if upto.startswith(self.text) else ""
        self.text += new
        return new


def _partial_stop(text: str, stop: str) -> int:
    """How many characters at the end of `text` begin `stop`."""
    for length in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:length]):
            return length
    return 0
