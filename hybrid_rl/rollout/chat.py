"""Token-level chat assembly for multi-turn trajectories (shared by the agent loop and SFT).

The trajectory is built from the token ids the model actually generated plus the *tokenised
delta* that the chat template inserts for tool/user turns; the earlier text is never
re-tokenised (re-tokenising decoded text can merge or split tokens differently and silently
shift the loss mask).
"""

from __future__ import annotations

import re
import uuid
from typing import Any

_PROBE_USER = {"role": "user", "content": "x"}
_PROBE_ASSISTANT = {"role": "assistant", "content": "y"}


def turn_delta_text(tokenizer: Any, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """Text the chat template puts after an assistant turn's end-of-turn token, for ``messages``.

    For Qwen-style templates: ``"\\n<|im_start|>user\\n<tool_response>...</tool_response><|im_end|>\\n<|im_start|>assistant\\n"``.
    Computed by rendering a probe conversation with and without ``messages`` and taking the
    difference, so any template with a stable prefix works.
    """
    base = [_PROBE_USER, _PROBE_ASSISTANT]
    before = tokenizer.apply_chat_template(base, tokenize=False)
    after = tokenizer.apply_chat_template(base + messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    if not after.startswith(before):
        raise ValueError("the chat template does not render a conversation as a prefix of its continuation")
    eos = tokenizer.eos_token or ""
    # What follows the assistant's end-of-turn token in `before` (e.g. "\n") was not generated.
    tail = before[before.rindex(eos) + len(eos) :] if eos and eos in before else ""
    return tail + after[len(before) :]


def encode_delta(tokenizer: Any, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    return tokenizer(turn_delta_text(tokenizer, messages, add_generation_prompt), add_special_tokens=False)["input_ids"]


def _added_token_pattern(tokenizer: Any) -> re.Pattern | None:
    texts = sorted({t.content for t in tokenizer.added_tokens_decoder.values() if t.content}, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, texts))) if texts else None


def encode_data(tokenizer: Any, text: str) -> list[int]:
    """Token ids for ``text`` as plain data: control-token text (``<|im_end|>``, ``<tool_call>``, any
    added token) becomes ordinary text tokens, never the control token itself.

    Each occurrence of an added token's text is encoded in two pieces (its first character,
    then the rest), which the tokenizer cannot merge back into the added token; decoding gives
    the same text. Used for tool output, so a program cannot forge turns in the model's context.
    """
    pattern = _added_token_pattern(tokenizer)
    added = set(tokenizer.added_tokens_decoder)

    def enc(piece: str) -> list[int]:
        if not piece:
            return []
        ids = tokenizer(piece, add_special_tokens=False)["input_ids"]
        if added.intersection(ids):  # a suffix that is itself an added token: one character at a time
            ids = [i for ch in piece for i in tokenizer(ch, add_special_tokens=False)["input_ids"]]
        return ids

    if pattern is None:
        return enc(text)
    ids: list[int] = []
    pos = 0
    for m in pattern.finditer(text):
        ids += enc(text[pos : m.start()]) + enc(m.group()[:1]) + enc(m.group()[1:])
        pos = m.end()
    return ids + enc(text[pos:])


def encode_tool_turn(tokenizer: Any, role: str, content: str, add_generation_prompt: bool = True) -> list[int]:
    """The template's delta for one ``role`` turn whose ``content`` is data (see :func:`encode_data`):
    the template's own text around the content keeps its control tokens."""
    marker = f"HYBRIDRLDATA{uuid.uuid4().hex}"
    text = turn_delta_text(tokenizer, [{"role": role, "content": marker}], add_generation_prompt)
    if text.count(marker) != 1:
        raise ValueError("the chat template must render a tool turn's content exactly once")
    before, after = text.split(marker)
    enc = tokenizer(before, add_special_tokens=False)["input_ids"]
    return enc + encode_data(tokenizer, content) + tokenizer(after, add_special_tokens=False)["input_ids"]


def assemble_trajectory(tokenizer: Any, prompt_ids: list[int], turns: list[tuple[str, str]]) -> tuple[list[int], list[int]]:
    """Response ids and loss mask for alternating turns ``[("assistant", text), ("tool", text), ...]``.

    Assistant turns are tokenised as the model would have produced them (text + end-of-turn
    token, mask 1); tool turns are the template's delta (mask 0). Used to build SFT data for
    tool use with exactly the token layout the agent loop produces at rollout time.
    """
    ids: list[int] = []
    mask: list[int] = []
    eos = tokenizer.eos_token or ""
    for role, text in turns:
        if role == "assistant":
            t = tokenizer(text + eos, add_special_tokens=False)["input_ids"]
            ids += t
            mask += [1] * len(t)
        else:
            t = encode_tool_turn(tokenizer, role, text)
            ids += t
            mask += [0] * len(t)
    return ids, mask
