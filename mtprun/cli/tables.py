"""The two-column tables `mtprun plan` prints: a bold name, then its value, no header."""

from __future__ import annotations

from rich.table import Table


def key_value_table(title: str) -> Table:
    """An empty table titled `title` whose rows are (name, value)."""
    table = Table(title=title, show_header=False)
    table.add_column(style="bold")
    table.add_column()
    return table
