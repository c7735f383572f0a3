"""`tensorsmith generate OUT`: text from a decoder artifact, with its tokenizer when it has one."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import click
import numpy as np
from rich.markup import escape

from tensorsmith.cli.output import backend_option, emit_json, handle_errors, stdout
from tensorsmith.runtime.errors import TensorsmithError

if TYPE_CHECKING:
    from tokenizers import Tokenizer


def _tokenizer(artifact: Path) -> Tokenizer | None:
    """The artifact's tokenizer (tokenizer/tokenizer.json), or None without one."""
    path = artifact / "tokenizer" / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


@click.command("generate")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--prompt", help="Text, tokenized with the artifact's tokenizer.")
@click.option("--prompt-ids", help="Token ids, comma separated (e.g. 1,2,3).")
@click.option("--max-new-tokens", type=int, default=32, show_default=True)
@click.option("--do-sample", is_flag=True, help="Sample instead of greedy decoding.")
@click.option("--temperature", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True)
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--seed", type=int, help="Seed for --do-sample.")
@click.option("--num-beams", type=int, default=1, show_default=True)
@backend_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@handle_errors
def generate_command(
    artifact: Path,
    prompt: str | None,
    prompt_ids: str | None,
    max_new_tokens: int,
    do_sample: bool,
    temperature: float,
    top_k: int,
    top_p: float,
    seed: int | None,
    num_beams: int,
    backend: str,
    as_json: bool,
) -> None:
    """Generate from the decoder artifact ARTIFACT: prefill the prompt, then one token per step."""
    from tensorsmith.runtime import load
    from tensorsmith.runtime.generation_request import check_request
    from tensorsmith.runtime.manifest import read_manifest
    from tensorsmith.runtime.sampling import Sampling

    if (prompt is None) == (prompt_ids is None):
        raise TensorsmithError("give one of --prompt TEXT or --prompt-ids 1,2,3", hint="see tensorsmith generate -h")
    tokenizer = _tokenizer(artifact)
    if prompt is not None:
        if tokenizer is None:
            raise TensorsmithError(f"{artifact} has no tokenizer", hint="pass --prompt-ids instead of --prompt")
        ids = tokenizer.encode(prompt, add_special_tokens=True).ids
    else:
        try:
            ids = [int(part) for part in (prompt_ids or "").split(",") if part.strip()]
        except ValueError as err:
            raise TensorsmithError(f"--prompt-ids {prompt_ids!r} is not comma-separated integers") from err
    if not ids:
        raise TensorsmithError("the prompt has no tokens", hint="give a longer --prompt or --prompt-ids")
    # the settings and ids checked as generate() checks them, but before the load (the slow part on a GPU)
    check_request(
        read_manifest(artifact),
        str(artifact),
        np.array([ids]),
        None,
        max_new_tokens,
        Sampling(do_sample, temperature, top_k, top_p),
        num_beams,
        seed=seed,
    )
    stamps: list[float] = []  # when each new token came: the first ends the prefill
    with load(artifact, backend=backend) as model:
        started = time.perf_counter()
        sequences = model.generate(
            np.array([ids]),
            max_new_tokens=max_new_tokens,
            do_sample=do_sample,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            num_beams=num_beams,
            seed=seed,
            streamer=lambda _: stamps.append(time.perf_counter()),
        )
        backend_name = model.backend
    new_tokens = sequences[0, len(ids) :].tolist()
    text = tokenizer.decode(new_tokens) if tokenizer is not None else None
    prefill_ms = (stamps[0] - started) * 1e3 if stamps else 0.0
    decode_rate = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 and stamps[-1] > stamps[0] else 0.0
    if as_json:
        emit_json(
            {
                "ok": True,
                "sequences": sequences.tolist(),
                "new_tokens": new_tokens,
                "text": text,
                "backend": backend_name,
                "prefill_ms": round(prefill_ms, 3),
                "decode_tokens_per_second": round(decode_rate, 1),
            }
        )
        return
    continuation = text if text is not None else " ".join(map(str, new_tokens))
    if prompt is not None:  # the prompt in bold, then what the model wrote (escaped: text may hold [brackets])
        stdout.print(f"[bold]{escape(prompt)}[/]{escape(continuation)}")
    else:
        stdout.print(continuation, markup=False)
    if stamps:  # beam search reports its sequences at the end only
        stdout.print(f"[dim]{backend_name}: prefill {prefill_ms:.1f} ms, decode {decode_rate:.1f} tokens/s[/]")
