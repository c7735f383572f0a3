"""The requests the server takes, with OpenAI's field names. Fields OpenAI has and this server does not do are
refused by name (a 400 naming the field), not ignored; fields no OpenAI client sends are ignored, as OpenAI does.
"""

from __future__ import annotations

from typing import Literal, TypedDict

from pydantic import BaseModel, ConfigDict, Field

from tensorsmith.serve.errors import OpenAIError


class EngineSampling(TypedDict):
    """GenerationEngine.submit's sampling settings."""

    do_sample: bool
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    ignore_eos: bool


class StreamOptions(BaseModel):
    include_usage: bool = False


class GenerationFields(BaseModel):
    """What completions and chat completions share: sampling, stops, streaming."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, description="vLLM's extra: 0 keeps every token")
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0)
    ignore_eos: bool = Field(False, description="vLLM's extra: generate max_tokens whatever comes")
    return_token_ids: bool = Field(False, description="vLLM's extra: each choice and chunk carries its token ids")
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: object = None  # any value but null and false is refused by `check`

    def check(self) -> None:
        """Refuse, naming the field, what this server does not do."""
        unsupported = {
            "n": self.n != 1,
            "presence_penalty": self.presence_penalty != 0,
            "frequency_penalty": self.frequency_penalty != 0,
            "logprobs": self.logprobs not in (None, False),
        }
        for name, refused in unsupported.items():
            if refused:
                raise OpenAIError(
                    400, f"{name} is not supported by this server", param=name, hint="leave it at its default"
                )

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling(self) -> EngineSampling:
        """The engine's settings: temperature 0 is greedy, as OpenAI's and vLLM's."""
        greedy = self.temperature == 0
        return {
            "do_sample": not greedy,
            "temperature": 1.0 if greedy else self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "ignore_eos": self.ignore_eos,
        }


class CompletionRequest(GenerationFields):
    prompt: str | list[int] | list[str]
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False
    suffix: str | None = None

    def check(self) -> None:
        super().check()
        if self.echo or self.suffix:
            name = "echo" if self.echo else "suffix"
            raise OpenAIError(400, f"{name} is not supported by this server", param=name)
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str) and len(self.prompt) != 1:
            raise OpenAIError(
                400,
                f"prompt is a list of {len(self.prompt)} texts; this server takes one per request",
                param="prompt",
                hint="send each prompt as its own request",
            )

    @property
    def single_prompt(self) -> str | list[int]:
        """The one prompt: text, or token ids (a list of one text is its text)."""
        if self.prompt and isinstance(self.prompt, list) and isinstance(self.prompt[0], str):
            return str(self.prompt[0])
        return self.prompt if isinstance(self.prompt, str) else [int(token) for token in self.prompt]


class ContentPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id...: handed to the template as they are

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def for_template(self) -> dict[str, object]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {**self.model_dump(exclude_none=True), "content": content or ""}


class ChatCompletionRequest(GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | list[str] = Field(min_length=1)
    encoding_format: Literal["float", "base64"] = "float"  # base64: float32 little-endian (OpenAI's client asks it)

    @property
    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)
