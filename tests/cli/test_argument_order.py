"""Every command takes its options and its positionals (recipe, KEY=VALUE overrides, run
folder) in any order; a malformed override or an unknown option is still a clear error."""

from __future__ import annotations

from pathlib import Path

import pytest

from mtprun.cli import COMMANDS, build_parser, main
from mtprun.cli.diagnostics import split_overrides

REPO = Path(__file__).resolve().parents[2]
RECIPE = str(REPO / "recipes" / "sft-zloss.yaml")

# Per command: the same arguments in several orders, options first, between and last.
ORDERS = {
    "run": [
        ["run", "r.yaml", "a=1", "b=2", "--resume", "--ray-address", "h:1"],
        ["run", "--resume", "r.yaml", "a=1", "--ray-address", "h:1", "b=2"],
        ["run", "r.yaml", "--ray-address", "h:1", "a=1", "--resume", "b=2"],
        ["r.yaml", "a=1", "--resume", "b=2", "--ray-address", "h:1"],  # `mtprun RECIPE`
    ],
    "validate": [  # no options: the file among the overrides
        ["validate", "r.yaml", "a=1", "b=2"],
        ["validate", "a=1", "r.yaml", "b=2"],
        ["validate", "a=1", "b=2", "r.yaml"],
    ],
    "plan": [
        ["plan", "r.yaml", "a=1", "b=2", "--json", "--head", "64", "128"],
        ["plan", "--json", "r.yaml", "a=1", "--head", "64", "128", "b=2"],
        ["plan", "r.yaml", "--head", "64", "128", "a=1", "b=2", "--json"],
    ],
    "inspect-data": [
        ["inspect-data", "r.yaml", "a=1", "b=2", "-n", "1"],
        ["inspect-data", "r.yaml", "-n", "1", "a=1", "b=2"],
        ["inspect-data", "-n", "1", "r.yaml", "a=1", "b=2"],
        ["inspect-data", "r.yaml", "a=1", "--num-samples", "1", "b=2"],
    ],
    "resume": [
        ["resume", "runs/x", "--ray-address", "h:1"],
        ["resume", "--ray-address", "h:1", "runs/x"],
    ],
    "export": [
        ["export", "runs/x", "--step", "4", "--out", "o", "--merge"],
        ["export", "--step", "4", "runs/x", "--merge", "--out", "o"],
        ["export", "--merge", "--out", "o", "--step", "4", "runs/x"],
    ],
    "eval": [
        ["eval", "runs/x", "--step", "4", "--ray-address", "h:1"],
        ["eval", "--step", "4", "runs/x", "--ray-address", "h:1"],
    ],
    "ui": [
        ["ui", "runs/x", "--port", "5001", "--host", "0.0.0.0"],
        ["ui", "--port", "5001", "runs/x", "--host", "0.0.0.0"],
    ],
    "sync": [
        ["sync", "runs/x", "--timeout", "5"],
        ["sync", "--timeout", "5", "runs/x"],
    ],
    "schema": [["schema", "-o", "s.json"], ["schema", "--output", "s.json"]],
}


def _parsed(argv: list[str]) -> dict:
    if argv[0].endswith(".yaml"):
        argv = ["run", *argv]  # as main() does
    parsed = vars(build_parser().parse_args(argv))
    if parsed["command"] == "validate":  # one positional, split by the command itself
        (parsed["recipe"],), parsed["overrides"] = split_overrides(parsed.pop("args"))
    return parsed


def test_every_command_is_covered() -> None:
    assert set(ORDERS) == set(COMMANDS.names())


@pytest.mark.parametrize("command", sorted(ORDERS))
def test_options_and_positionals_in_any_order_parse_alike(command: str) -> None:
    first, *others = ORDERS[command]
    expected = _parsed(first)
    for argv in others:
        assert _parsed(argv) == expected, argv
    if "overrides" in expected:
        assert expected["recipe"] == "r.yaml"
        assert expected["overrides"] == ["a=1", "b=2"]


def test_inspect_data_takes_overrides_after_its_option(capsys) -> None:
    assert main(["inspect-data", RECIPE, "-n", "1", "mask=all", "seed=3"]) == 0
    out = capsys.readouterr().out
    assert "mask all" in out  # the override after -n applied
    assert out.count("sample ") == 1


def test_a_malformed_override_after_an_option_is_reported_as_such(capsys) -> None:
    assert main(["plan", RECIPE, "--json", "trainer.lr", "mask=all"]) == 2
    err = capsys.readouterr().err
    assert "expected KEY=VALUE (e.g. trainer.lr=3e-5), got 'trainer.lr'" in err


def test_an_unknown_option_among_overrides_is_named_alone(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["inspect-data", RECIPE, "mask=all", "--samples", "2", "seed=3"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "usage: mtprun inspect-data" in err
    assert err.strip().endswith("mtprun inspect-data: error: unrecognized arguments: --samples")
