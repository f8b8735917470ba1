"""Text in and out: a model folder's tokenizer and chat template, turning messages into token ids once.

What it models: the text side of an agent run. `ChatTokenizer(folder)` loads the tokenizer and chat template
of a Hugging Face model folder (tokenizer.json, tokenizer_config.json, chat template) with `transformers`,
no download. `prompt(messages)` is the conversation's token ids up to the generation prompt; `turn(history,
message)` the ids a new message (a tool result) adds after the model's reply, generation prompt included;
`decode(ids)` the model's text. Text a tool returns is encoded with `split_special_tokens`: a tool cannot
forge a chat marker or a stop token, it only appears as plain text.

`turn` renders the template twice (the history with and without the message) and keeps the difference; a
template for which the history is no prefix of the longer rendering (one that rewrites earlier turns) falls
back to rendering the message alone. A ChatTokenizer pickles as its folder's path (loaded once per process).
`build_tiny_chat_tokenizer` trains the small byte-level BPE the tests and the CPU config use (configs/tiny_chat).

Simplifications: messages are {"role", "content"} with string content; no tool-call schema in the template.
"""

from __future__ import annotations

import functools
from pathlib import Path

SENTINEL = "\x00GYRE-CONTENT\x00"
TINY_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
TINY_SPECIALS = ["<|end|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|pad|>"]


@functools.lru_cache(maxsize=8)
def _load(folder: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot load a tokenizer from {folder}: {str(exc).splitlines()[0]}") from None


class ChatTokenizer:
    def __init__(self, folder: str | Path) -> None:
        self.folder = str(Path(folder).resolve())
        self.tok = _load(self.folder)  # one per folder and process: groups and their copies share it
        if not self.tok.chat_template:
            raise ValueError(f"the tokenizer in {folder} has no chat template")
        if self.tok.eos_token_id is None:
            raise ValueError(f"the tokenizer in {folder} has no eos token")
        self.stop = [int(self.tok.eos_token_id)]
        self.vocab_size = len(self.tok)

    def __reduce__(self):
        return ChatTokenizer, (self.folder,)  # pickled as its folder (a tool worker scoring a group loads it once)

    def _render(self, messages: list[dict], gen: bool) -> str:
        return self.tok.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)

    def prompt(self, messages: list[dict]) -> list[int]:
        return self.tok.encode(self._render(messages, True), add_special_tokens=False)

    def turn(self, history: list[dict], message: dict, max_tokens: int | None = None) -> list[int]:
        """The ids `message` adds after `history` (which ends with the model's reply), up to the next reply; its
        content cut to fit `max_tokens` in all, the template's markers kept."""
        marked = {**message, "content": SENTINEL}
        full, before = self._render(history + [marked], True), self._render(history, False)
        frag = full[len(before):] if full.startswith(before) else self._render([marked], True)
        head, _, tail = frag.partition(SENTINEL)
        enc = self.tok.encode
        head_ids, tail_ids = enc(head, add_special_tokens=False), enc(tail, add_special_tokens=False)
        body = enc(message["content"], add_special_tokens=False, split_special_tokens=True)
        if max_tokens is not None:
            body = body[: max(0, max_tokens - len(head_ids) - len(tail_ids))]
        return head_ids + body + tail_ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


def build_tiny_chat_tokenizer(folder: str | Path, vocab_size: int = 384) -> Path:
    """Train a byte-level BPE on a small built-in corpus and save it with the tiny chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [
        "def solve(x):\n    return x + 1\n", "for i in range(10):\n    print(i)\n", "import math\n",
        "class Solution:\n    def add(self, a, b):\n        return a + b\n", "assert f(2) == 4\n",
        "Write a Python function that returns the sum of a list of numbers.", "passed 1/3 tests; error: ",
        "```python\n```", "while True:\n    pass\n", "if n % 2 == 0:\n    return n // 2\n", "lambda s: s[::-1]\n",
    ] * 4
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=TINY_SPECIALS,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|end|>", pad_token="<|pad|>")
    fast.chat_template = TINY_TEMPLATE
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    return out
