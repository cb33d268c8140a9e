"""The terminal chat: a multi-turn conversation whose later turns reuse the KV cache of earlier ones.

Turn n+1's tokens are the conversation so far (exactly the tokens the model saw and generated, never a
re-tokenization of the reply text) followed by what the chat template adds for the new user message.
The template is rendered as text with and without the new message; the difference, plus whatever the
template writes after the end-of-turn token the model generated (e.g. a newline), is the new turn.
Only those tokens and the previous turn's last token are prefilled.

Replies are also kept in a memory of this process (decoding/warm.py) that drafting searches, so it
survives /reset; it never leaves the process.

Commands: /stats (the last turn's full statistics), /reset (new conversation, new cloud session), /exit.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from ..decoding.sampling import SamplingConfig
from ..decoding.warm import SUFFIX_MEMORY_TOKENS, suffix_memory
from ..errors import ConfigError
from ..local.client import SplitClient
from ..local.config import CLIENT_DEFAULTS
from ..local.conversation import Turn
from ..local.text import chat_prompt_ids, has_chat_template


class ChatSession:
    """A terminal chat over one conversation; a context manager (leaving it ends the cloud session)."""

    def __init__(self, client: SplitClient, system: str | None = None, strategy: str = CLIENT_DEFAULTS.strategy,
                 metrics=None, memory_tokens: int = SUFFIX_MEMORY_TOKENS):
        tok = client.local.tokenizer
        if not has_chat_template(tok):
            raise ConfigError("this local shard has no tokenizer with a chat template; use `generate --no-chat`.")
        self.client = client
        self.tokenizer = tok
        self.system = system
        self.conversation = client.conversation(strategy, metrics, suffix_memory(memory_tokens))
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []
        self.last: Turn | None = None

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)

    def new_turn_ids(self, user: str) -> list[int]:
        """The tokens to append to the conversation for the next user message."""
        messages = self.messages + [{"role": "user", "content": user}]
        if self.last is None:
            return chat_prompt_ids(self.tokenizer, messages)
        before = self._render(self.messages, generation_prompt=False)
        after = self._render(messages, generation_prompt=True)
        if not after.startswith(before):
            raise ConfigError("this chat template rewrites earlier turns; /reset to start a new conversation.")
        eos = self.tokenizer.eos_token or ""
        # What the template writes after the assistant's end-of-turn token, which the model did not generate.
        cut = before.rfind(eos) if eos else -1
        tail = before[cut + len(eos) :] if cut >= 0 else ""
        if self.last.finish_reason != "stop" or not self.last.token_ids:
            tail = eos + tail  # the reply was cut by the length limit: close the turn as the template would
        text = tail + after[len(before) :]
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def say(self, user: str, max_new_tokens: int, sampling: SamplingConfig | None = None,
            on_text: Callable[[str], None] | None = None) -> Turn:
        ids = self.new_turn_ids(user)
        turn = self.conversation.send(ids, max_new_tokens, sampling, on_text=on_text)
        self.messages += [{"role": "user", "content": user}, {"role": "assistant", "content": turn.text}]
        self.last = turn
        return turn

    def reset(self) -> None:
        self.conversation.reset()
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.last = None

    def close(self) -> None:
        self.conversation.close()

    def __enter__(self) -> ChatSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def summary_line(turn: Turn) -> str:
    s = turn.stats
    return (
        f"[{len(turn.token_ids)} tok, {s['tokens_per_s']:.1f} tok/s, {s['mean_accepted_per_step']:.2f} accepted/step, "
        f"round trip {s['median_ms']['round_trip']:.1f} ms (network {s['median_ms']['network']:.1f}), prefilled {turn.prefilled_tokens} new of "
        f"{turn.prompt_tokens} tok, {turn.finish_reason}]"
    )


def stats_text(chat: ChatSession) -> str:
    if chat.last is None:
        return "no turn yet."
    s = chat.last.stats
    med = s["median_ms"]
    lines = [
        f"conversation: {len(chat.conversation.history)} tokens, {chat.conversation.cached_tokens} cached, "
        f"{len(chat.messages) // 2} turn(s)",
        f"last turn: {s['generated_tokens']} tokens in {s['steps']} steps, {s['tokens_per_s']:.2f} tok/s, "
        f"{s['mean_accepted_per_step']:.2f} accepted/step (max {s['max_accepted_per_step']}), {s['strategy']}",
        f"prefill: {turn_prefill(chat.last)}, {s['prefill_ms']:.1f} ms",
        f"median step {med['step']:.2f} ms = round trip {med['round_trip']:.2f} (network {med['network']:.2f}, "
        f"cloud {med['cloud_compute']:.2f}) + local {med['local_compute']:.2f} + serialize {med['serialize']:.3f}",
        f"bytes up/down: {s['bytes_up']} / {s['bytes_down']}, recoveries: {s['recoveries']}",
    ]
    return "\n".join(lines)


def turn_prefill(turn: Turn) -> str:
    return f"{turn.prefilled_tokens} new tokens ({turn.prompt_tokens - turn.prefilled_tokens} reused from the cache)"


def run_chat(chat: ChatSession, max_new_tokens: int, sampling: SamplingConfig | None, read=input,
             write: Callable[[str], None] | None = None) -> int:
    """The read-eval-print loop; `read` raises EOFError at the end of input."""
    def default_write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    write = write or default_write
    write("splitinfer chat: /stats, /reset, /exit\n")
    while True:
        try:
            line = read("> ").strip()
        except EOFError:
            write("\n")
            return 0
        if not line:
            continue
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            chat.reset()
            write("(new conversation)\n")
            continue
        if line == "/stats":
            write(stats_text(chat) + "\n")
            continue
        if line.startswith("/"):
            write(f"unknown command {line}; use /stats, /reset or /exit.\n")
            continue
        turn = chat.say(line, max_new_tokens, sampling, on_text=write)
        write("\n" + summary_line(turn) + "\n")
