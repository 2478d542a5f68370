"""How a question becomes a prompt, and a worked solution a training target.

Chat models get the question as a user message through their chat template,
with one instruction to end on `#### N`. Models without a chat template (the
built-in tiny policy) read the question followed by a newline and answer with
the worked solution, then EOS: exactly the format `fp8rl sft` teaches.
"""

from __future__ import annotations

from typing import Any

ANSWER_INSTRUCTION = "Solve step by step. End with a final line of the form '#### <number>'."


def format_prompt(tokenizer: Any, question: str, system_prompt: str = "") -> str:
    if tokenizer.chat_template:
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": f"{question}\n{ANSWER_INSTRUCTION}"})
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return f"{question}\n"


def encode_prompts(tokenizer: Any, questions: list[str], system_prompt: str = "") -> list[list[int]]:
    ids = [tokenizer.encode(format_prompt(tokenizer, q, system_prompt)) for q in questions]
    if tokenizer.bos_token_id is not None and not tokenizer.chat_template:
        ids = [[tokenizer.bos_token_id] + x if not x or x[0] != tokenizer.bos_token_id else x for x in ids]
    return ids
