"""Train samples/tinylm: a small Llama-architecture model on text that ships with CPython (pydoc_data.topics and
the standard library's docstrings), with a byte-level BPE tokenizer trained on the same text.

    python -m tensorsmith.samples.tinylm.train      # writes samples/tinylm/checkpoint/ and heldout.txt

Seeded; on 2 CPU cores it takes about ten minutes. The checkpoint is committed (a few MB of safetensors), so
neither `make demo` nor `make test` trains. The held-out documents (every 20th, by name) are never trained on:
they are the evaluation text for perplexity.
"""

from __future__ import annotations

import ast
import hashlib
import math
import sysconfig
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CHECKPOINT = HERE / "checkpoint"
HELDOUT = HERE / "heldout.txt"
VOCABULARY = 2048
CONTEXT = 128
STEPS = 1500
BATCH = 32
SPECIAL = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2


def documents() -> dict[str, str]:
    """Name → text: every pydoc topic, and the docstrings of each standard-library module (read with ast, never
    imported), in a fixed order."""
    import pydoc_data.topics

    found = {f"topic:{name}": text for name, text in sorted(pydoc_data.topics.topics.items())}
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        strings = [
            ast.get_docstring(node)
            for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        ]
        text = "\n\n".join(s for s in strings if s and len(s) > 40)
        if text:
            found[f"module:{path.stem}"] = text
    return found


def is_heldout(name: str) -> bool:
    return int(hashlib.sha256(name.encode()).hexdigest(), 16) % 20 == 0


# A chat format for `tensorsmith serve`'s /v1/chat/completions: "role: content" lines, the assistant's turn
# opened last. The model never saw chats (it knows the standard library's docs), so its answers are docs-like.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


def train_tokenizer(texts: list[str]) -> object:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCABULARY,
        special_tokens=SPECIAL,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def main() -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    torch.set_num_threads(2)
    docs = documents()
    train_texts = [text for name, text in docs.items() if not is_heldout(name)]
    HELDOUT.write_text("\n\n".join(text for name, text in docs.items() if is_heldout(name)) + "\n")
    tokenizer = train_tokenizer(train_texts)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    ids = [token for text in train_texts for token in [1, *tokenizer.encode(text).ids, 2]]  # type: ignore[attr-defined]
    data = torch.tensor(ids, dtype=torch.long)
    print(f"{len(docs)} documents, {len(train_texts)} for training, {len(data)} tokens")

    config = LlamaConfig(
        vocab_size=VOCABULARY,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2 * CONTEXT * 2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, step / 100) * 0.5 * (1 + math.cos(math.pi * min(step, STEPS) / STEPS))
    )
    generator = torch.Generator().manual_seed(0)
    started = time.perf_counter()
    for step in range(STEPS):
        starts = torch.randint(0, len(data) - CONTEXT - 1, (BATCH,), generator=generator)
        batch = torch.stack([data[s : s + CONTEXT] for s in starts])
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 100 == 0 or step == STEPS - 1:
            print(f"step {step}: loss {loss.item():.3f} ({time.perf_counter() - started:.0f} s)", flush=True)
    model.eval()
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 0
    model.save_pretrained(str(CHECKPOINT))
    fast.save_pretrained(str(CHECKPOINT))
    print(f"wrote {CHECKPOINT}")


if __name__ == "__main__":
    main()
