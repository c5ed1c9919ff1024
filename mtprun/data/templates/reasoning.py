"""Reasoning in a generated turn read by mtprun's own templates (the `renderers` families
parse it with their own `parse_response`): a leading `<think>...</think>` block is the turn's
reasoning, what follows it the answer (content and tool calls).

    <think>
    37*14 is 518, plus 5.
    </think>

    523

A turn whose generation prompt already opened the block (the template prints `<think>` at
the end of the prompt) starts inside it: its reasoning runs to `</think>`. A block left open
(the turn was cut off while thinking) is all reasoning and no answer.
"""

from __future__ import annotations

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


def split_reasoning(text: str, opened: bool = False) -> tuple[str, str]:
    """(reasoning, answer) of a generated turn's text (stop token already stripped);
    `opened`: the prompt ended inside an open `<think>` block. Text without a leading block
    is all answer (reasoning "")."""
    body = text
    if not opened:
        stripped = text.lstrip()
        if not stripped.startswith(THINK_OPEN):
            return "", text
        body = stripped[len(THINK_OPEN) :]
    reasoning, closed, answer = body.partition(THINK_CLOSE)
    if not closed:
        return reasoning.strip("\n"), ""
    return reasoning.strip("\n"), answer.lstrip("\n")


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """Whether a prompt's text ends with an open `<think>` (the generation prompt printed
    it, so the turn starts thinking)."""
    return prompt_text.rstrip().endswith(THINK_OPEN)
