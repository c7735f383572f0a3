"""The OpenAI-compatible app over one artifact: `/v1/models`, `/v1/completions`, `/v1/chat/completions`,
`/v1/embeddings`, `/health`, `/metrics`.

The artifact loads in a worker thread after the server starts, so `/health` answers 503 until it is ready and
200 after. A decoder gets a continuous-batching engine (runtime/engine.py), an encoder the runtime's
`DynamicBatcher` (serve/embeddings.py). At shutdown (uvicorn's, on SIGTERM: no new connections, the open ones
finished) the engine finishes what it runs and is released.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import signal
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from tensorsmith.serve.errors import OpenAIError
from tensorsmith.serve.generation import Completion
from tensorsmith.serve.protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest, GenerationFields
from tensorsmith.serve.responses import DONE, Answer, sse
from tensorsmith.serve.served import Served, ServeSettings

logger = logging.getLogger(__name__)


def create_app(settings: ServeSettings, on_ready: Callable[[Served], None] | None = None) -> FastAPI:
    """The app; `on_ready(served)` is called once the artifact is loaded (the CLI's "serving …" line)."""
    served = Served(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loading = asyncio.create_task(_load(served, on_ready))
        yield
        loading.cancel()
        await asyncio.to_thread(served.close)

    app = FastAPI(title="tensorsmith", lifespan=lifespan)
    app.state.served = served

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, err: OpenAIError) -> JSONResponse:
        if served.metrics is not None:
            served.metrics.failed(err.status)
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0]
        param = ".".join(str(part) for part in first.get("loc", ())[1:]) or None
        return await openai_error(request, OpenAIError(400, f"{param or 'the body'}: {first.get('msg')}", param))

    @app.get("/health")
    async def health() -> Response:
        if served.error is not None:
            return JSONResponse({"status": "failed", "error": served.error}, status_code=503)
        ready = served.ready
        return JSONResponse({"status": "ok" if ready else "loading"}, status_code=200 if ready else 503)

    @app.get("/v1/models")
    async def models() -> dict[str, object]:
        served.check(None)
        card = {"id": served.name, "object": "model", "created": served.created, "owned_by": "tensorsmith"}
        if served.engine is not None:
            card["max_model_len"] = served.engine.capacity
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics() -> Response:
        stats = served.engine.stats() if served.engine is not None else None
        body = served.metrics.render(stats) if served.metrics is not None else b""
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        engine, codec = served.generation(body.model)
        body.check()
        prompt = body.single_prompt
        ids = codec.encode(prompt) if isinstance(prompt, str) else prompt
        completion = Completion(engine, codec, ids, body.max_tokens, body.stops, body.sampling())
        return await _answer(served, completion, body, Answer.new(served.name, chat=False), request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        engine, codec = served.generation(body.model)
        body.check()
        text = codec.render_chat([message.for_template() for message in body.messages])
        ids = codec.encode(text, special=False)
        completion = Completion(engine, codec, ids, body.token_limit, body.stops, body.sampling(), "messages")
        return await _answer(served, completion, body, Answer.new(served.name, chat=True), request)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest) -> dict[str, object]:
        embedder = served.embeddings(body.model)
        vectors, tokens = await embedder.embed(body.texts)
        data = [
            {"object": "embedding", "index": index, "embedding": _encoded(vector, body.encoding_format)}
            for index, vector in enumerate(vectors)
        ]
        return {
            "object": "list",
            "data": data,
            "model": served.name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }

    return app


def _encoded(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    """A vector as numbers, or as base64 of its float32 little-endian bytes."""
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return [float(value) for value in vector]


async def _load(served: Served, on_ready: Callable[[Served], None] | None) -> None:
    try:
        await asyncio.to_thread(served.load)
        if on_ready is not None:
            on_ready(served)
    except Exception as err:  # any failure ends the server: it would only answer 503
        served.error = str(err)
        logger.error("could not load %s: %s", served.settings.artifact, err)
        os.kill(os.getpid(), signal.SIGTERM)


async def _answer(
    served: Served, completion: Completion, body: GenerationFields, answer: Answer, request: Request
) -> Response:
    """The whole answer, or its server-sent events; the request accounted for when it ends either way."""
    metrics = served.metrics
    assert metrics is not None
    endpoint = request.url.path
    if not body.stream:
        try:
            text = await completion.whole(request.is_disconnected)
        finally:
            completion.account(metrics, endpoint)
        stream = completion.stream
        return JSONResponse(
            answer.whole(text, completion.finish_reason, stream, stream.tokens if body.return_token_ids else None)
        )

    async def events() -> AsyncIterator[str]:
        try:
            yield answer.opening()
            try:
                async for piece in completion.pieces():
                    ids = [piece.token] if body.return_token_ids and piece.token is not None else None
                    if piece.text or ids:
                        yield answer.piece(piece.text, ids)
            except OpenAIError as err:  # the status is sent already: the error goes as an event, as vLLM does
                yield sse(err.body())
                yield DONE
                return
            yield answer.closing(completion.finish_reason)
            if body.include_usage:
                yield answer.usage_chunk(completion.stream)
            yield DONE
        finally:
            completion.account(metrics, endpoint)

    return StreamingResponse(events(), media_type="text/event-stream")
