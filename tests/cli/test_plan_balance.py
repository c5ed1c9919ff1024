"""`mtprun plan` says whether each RL step's sequences are balanced across data-parallel
replicas (trainer.balance), and why not when they are not."""

from __future__ import annotations

import json
from pathlib import Path

from mtprun.cli import main

QUICKSTART = Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml"
SFT = QUICKSTART.parent / "sft-zloss.yaml"


def _balance(capsys, *overrides: str) -> dict | None:
    assert main(["plan", str(QUICKSTART), *overrides, "--json"]) == 0
    return json.loads(capsys.readouterr().out)["balance"]


def test_plan_says_whether_balancing_applies(capsys, monkeypatch) -> None:
    two = ("parallel.dp=2", "resources.num_cpus=4")
    on = _balance(capsys, *two)
    assert on["applies"] and on["dp"] == 2 and on["why_not"] == ""
    assert on["linear_length"] > 0
    one = _balance(capsys)
    assert not one["applies"]
    assert one["why_not"] == "one data-parallel replica: nothing to balance"
    off = _balance(capsys, *two, "trainer.balance=false")
    assert not off["applies"] and off["why_not"].startswith("trainer.balance is false")
    assert main(["plan", str(SFT), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["balance"] is None

    monkeypatch.setenv("COLUMNS", "240")
    assert main(["plan", str(QUICKSTART), *two]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "dp balancing" in out and "on: each step's sequences split into 2 groups" in out
    assert main(["plan", str(QUICKSTART)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "off: one data-parallel replica: nothing to balance" in out
