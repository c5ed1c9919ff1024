"""An example user reward: named components, logged as reward/<name>, plus the `total`.

mtprun calls it with the arguments it names (any of prompt, completion, messages, answer):
`prompt` is the dataset row (every column: question, solution, op, difficulty), `completion`
the model's final answer text, `answer` the row's `solution` column (mapped in the recipe),
as a string.
"""

from __future__ import annotations


def score(prompt: dict, completion: str, answer: str) -> dict[str, float]:
    text = completion.strip()
    well_formed = text.isdigit()
    correct = well_formed and int(text) == int(answer)
    return {
        "correct": float(correct),
        "format": float(well_formed),
        # Carries are the harder half: a right answer there counts a little more.
        "total": float(correct) * (1.2 if prompt["difficulty"] == "carry" else 1.0)
        + 0.1 * float(well_formed),
    }
