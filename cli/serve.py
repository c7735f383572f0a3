"""`tensorsmith serve ARTIFACT`: the OpenAI-compatible server (serve/app.py) under uvicorn."""

from __future__ import annotations

import logging
import socket
import sys
from pathlib import Path

import click

from tensorsmith.cli.output import backend_option, emit_json, handle_errors, stdout
from tensorsmith.runtime.errors import TensorsmithError


@click.command("serve")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: every one).")
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--slots", type=int, default=8, show_default=True, help="Requests decoding together (cache slots).")
@click.option(
    "--max-queue", type=int, default=256, show_default=True, help="Requests waiting for a slot; more get 429."
)
@click.option("--max-sequence-length", type=int, help="Tokens per slot, prompt and completion [the compile's].")
@click.option("--prefill-chunk", type=int, default=256, show_default=True, help="Prompt tokens read per step.")
@click.option(
    "--enable-prefix-caching/--no-enable-prefix-caching",
    default=True,
    show_default=True,
    help="Reuse a slot's cache for a prompt that starts as an earlier one did (vLLM's flag).",
)
@click.option(
    "--chat-template",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="A jinja2 chat template file [the tokenizer's].",
)
@click.option(
    "--tokenizer",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="A folder with tokenizer.json, where the artifact has none.",
)
@click.option("--served-model-name", help="The model's id in the API [the artifact folder's name].")
@click.option("--metrics-prefix", type=click.Choice(["vllm:", "tensorsmith:"]), default="vllm:", show_default=True)
@backend_option
@click.option("--json", "as_json", is_flag=True, help="Announce the server as one JSON object on stdout.")
@handle_errors
def serve_command(
    artifact: Path,
    host: str,
    port: int,
    slots: int,
    max_queue: int,
    max_sequence_length: int | None,
    prefill_chunk: int,
    enable_prefix_caching: bool,
    chat_template: Path | None,
    tokenizer: Path | None,
    served_model_name: str | None,
    metrics_prefix: str,
    backend: str,
    as_json: bool,
) -> None:
    """Serve the artifact ARTIFACT over HTTP with OpenAI's API (completions, chat, embeddings) until SIGTERM."""
    try:
        import uvicorn

        from tensorsmith.serve.app import create_app
        from tensorsmith.serve.served import Served, ServeSettings
    except ImportError as err:
        raise TensorsmithError(f"the server needs {err.name}", hint="pip install 'tensorsmith[serve]'") from err
    from tensorsmith.runtime.manifest import read_manifest

    manifest = read_manifest(artifact)  # a missing or damaged artifact is named before the server starts
    limit = manifest.batch_limits()[0]
    if manifest.generation is not None and limit is not None and slots > limit:
        raise TensorsmithError(
            f"--slots {slots} is more than {artifact}'s largest batch, {limit}",
            hint=f"use --slots {limit} or fewer, or compile with a larger [generation] max_batch",
        )
    settings = ServeSettings(
        artifact=artifact,
        name=served_model_name or artifact.resolve().name,
        slots=slots,
        max_queue=max_queue,
        max_sequence_length=max_sequence_length,
        prefill_chunk=prefill_chunk,
        prefix_caching=enable_prefix_caching,
        chat_template=chat_template.read_text() if chat_template else None,
        tokenizer=tokenizer,
        metrics_prefix=metrics_prefix,
        backend=backend,
    )
    settings.tokenizer_folder()  # a missing tokenizer is named before the server starts too
    _check_address(host, port)
    url = f"http://{host}:{port}"

    def announce(served: Served) -> None:
        engine, model = served.engine, served.model
        assert model is not None
        capacity = f"{engine.slots} slots of {engine.capacity} tokens" if engine is not None else "embeddings"
        if as_json:
            emit_json(
                {
                    "ok": True,
                    "url": url,
                    "model": served.name,
                    "backend": model.backend,
                    "fallback_reason": model.fallback_reason,
                    "slots": engine.slots if engine else None,
                    "max_model_len": engine.capacity if engine else None,
                }
            )
        else:
            stdout.print(f"serving {served.name} at {url}/v1 on {model.backend} ({capacity})")

    logging.getLogger("tensorsmith.serve").setLevel(logging.INFO)  # the request lines, whatever -v says
    app = create_app(settings, announce)
    uvicorn.run(app, host=host, port=port, log_config=None, access_log=False)
    if app.state.served.error is not None:
        sys.exit(1)


def _check_address(host: str, port: int) -> None:
    """The address can be listened on: said as one line before the model loads, not as uvicorn's bind error."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    except OSError as err:
        raise TensorsmithError(
            f"cannot listen on {host}:{port}: {err.strerror}", hint="choose another --port, or stop what listens there"
        ) from err
