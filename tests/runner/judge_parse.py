"""`parse` functions of the served-judge tests (referenced as `path/to/judge_parse.py:fn`)."""


def length_if_even(reply: str) -> float:
    """The reply's length in characters; raises on an odd length (a reply it cannot read)."""
    if len(reply) % 2:
        raise ValueError(f"odd reply length {len(reply)}")
    return float(len(reply))


def garbage(reply: str) -> str:
    """Not a number: every episode it reads is an error."""
    return "not a score"
