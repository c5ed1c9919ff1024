"""MkDocs hook: the recipe reference page, generated from the recipe's pydantic models.

The field descriptions live once, in `mtprun/spec` (they also feed `mtprun schema` and
`recipes/schema.json`); this hook renders the same JSON Schema (`recipe_json_schema()`) as a
page at build time, so the reference is never written twice and cannot drift from the code.
The page exists only in the built site: nothing is written under docs/.
"""

from __future__ import annotations

import json
import re
from typing import Any, get_args

from mkdocs.structure.files import File, Files
from pydantic import BaseModel

from mtprun.spec.recipe import Recipe
from mtprun.spec.schema import recipe_json_schema

PAGE = "recipe-reference.md"

INTRO = """\
# Recipe reference

Every key a recipe file may hold, with its type, default and description. This page is
generated when the site is built, from the same pydantic models that validate recipes
(`mtprun/spec`), so it always matches the code; `mtprun schema` prints the same schema as JSON
Schema, and `recipes/schema.json` holds it for editors. [Writing recipes](recipes.md) explains
how the sections fit together, inheritance, overrides and the cross-field rules.

Reading the tables: a key without a default is required; `null` as a default means the
feature is off or the value is derived (the description says how). Unknown keys are errors
everywhere. A section that is a union (a loss term, a reward) has one table per variant; for
`losses` the `kind` key picks the variant.
"""


def on_files(files: Files, config: Any) -> Files:
    files.append(File.generated(config, PAGE, content=render(recipe_json_schema())))
    return files


# --- rendering ------------------------------------------------------------------------------


def render(schema: dict[str, Any]) -> str:
    return _Renderer(schema, _factory_defaults(Recipe)).page()


def _factory_defaults(root: type[BaseModel]) -> dict[tuple[str, str], Any]:
    """Defaults that come from a `default_factory`, which JSON Schema leaves out: keyed by
    (model title, field), read from the models themselves (the root is titled `Recipe`)."""
    found: dict[tuple[str, str], Any] = {}
    seen: set[type] = set()

    def visit(tp: Any) -> None:
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            if tp in seen:
                return
            seen.add(tp)
            title = tp.model_config.get("title") or tp.__name__
            for key, field in tp.model_fields.items():
                if field.default_factory is not None:
                    found[(title, key)] = field.get_default(call_default_factory=True)
                visit(field.annotation)
            return
        for arg in get_args(tp):
            visit(arg)

    visit(root)
    return found


def _anchor(def_name: str) -> str:
    return "def-" + def_name.lower()


def _ref_name(node: dict[str, Any]) -> str:
    return node["$ref"].rsplit("/", 1)[-1]


_CODE_SPAN = re.compile(r"(`[^`]*`)")


def _escape(text: str, in_table: bool) -> str:
    """Text from docstrings and Field descriptions as Markdown: code spans kept as they are,
    elsewhere the characters Markdown would read as HTML, emphasis or attribute lists
    escaped (descriptions say `runs/<name>`, `tp*pp`, `{question}`)."""
    parts = _CODE_SPAN.split(text)
    out = []
    for i, part in enumerate(parts):
        if i % 2 == 0:
            part = (
                part.replace("&", "&amp;")
                .replace("<", "&lt;")
                .replace(">", "&gt;")
                .replace("*", r"\*")
                .replace("{", "&#123;")
                .replace("}", "&#125;")
                .replace("[", r"\[")
            )
        if in_table:
            part = part.replace("|", r"\|")
        out.append(part)
    text = "".join(out)
    if in_table:
        text = " ".join(text.split())
    return text


def _value(value: Any) -> str:
    """A default or an enum member as it would be written in YAML."""
    if isinstance(value, BaseModel):
        return "its defaults"
    if isinstance(value, list) and value and all(isinstance(v, BaseModel) for v in value):
        kinds = [getattr(v, "kind", None) for v in value]
        if all(kinds):
            return "`[" + ", ".join(f"{{kind: {k}}}" for k in kinds) + "]`"
        return "its defaults"
    if value is None:
        return "`null`"
    if isinstance(value, str):
        return f"`{value}`" if value else '`""`'
    return f"`{json.dumps(value)}`".replace("|", r"\|")


class _Renderer:
    def __init__(self, schema: dict[str, Any], factory_defaults: dict[tuple[str, str], Any]):
        self.schema = schema
        self.factory_defaults = factory_defaults
        self.defs: dict[str, dict[str, Any]] = schema.get("$defs", {})
        self.paths: dict[str, list[str]] = {}  # def -> every recipe path it appears at
        self._collect("", schema)
        self.done: set[str] = set()
        self.out: list[str] = []

    # Where each model appears, so a shared one (a dataset spec) lists all its places.
    def _collect(self, path: str, node: dict[str, Any]) -> None:
        for key, prop in node.get("properties", {}).items():
            self._collect_node(f"{path}.{key}" if path else key, prop)

    def _collect_node(self, path: str, node: Any) -> None:
        if not isinstance(node, dict):
            return
        if "$ref" in node:
            name = _ref_name(node)
            seen = name in self.paths
            self.paths.setdefault(name, []).append(path)
            if not seen:
                self._collect(path, self.defs[name])
            return
        for key in ("anyOf", "oneOf"):
            for sub in node.get(key, []):
                self._collect_node(path, sub)
        if "items" in node:
            self._collect_node(path + "[]", node["items"])
        if isinstance(node.get("additionalProperties"), dict):
            self._collect_node(path + ".<key>", node["additionalProperties"])

    # Types -----------------------------------------------------------------------------------

    def type_of(self, node: dict[str, Any]) -> str:
        if "$ref" in node:
            name = _ref_name(node)
            return f"[{self._title(name)}](#{_anchor(name)})"
        if "const" in node:
            return _value(node["const"])
        if "enum" in node:
            return " or ".join(_value(v) for v in node["enum"])
        disc = node.get("discriminator")
        if disc:  # a tagged union: name each variant by its tag
            links = [
                f"[`{tag}`](#{_anchor(ref.rsplit('/', 1)[-1])})"
                for tag, ref in disc["mapping"].items()
            ]
            return f"by `{disc['propertyName']}`: " + ", ".join(links)
        for key in ("anyOf", "oneOf"):
            if key in node:
                parts = [self.type_of(sub) for sub in node[key]]
                return " or ".join(dict.fromkeys(parts))
        kind = node.get("type")
        if kind == "array":
            items = node.get("items")
            text = "list of " + (self.type_of(items) if items else "values")
            if node.get("minItems"):
                text += f" (at least {node['minItems']})"
            return text
        if kind == "object":
            names = node.get("propertyNames", {}).get("enum")
            extra = node.get("additionalProperties")
            value = self.type_of(extra) if isinstance(extra, dict) else "values"
            if names:
                return "mapping of " + ", ".join(_value(n) for n in names) + f" to {value}"
            return f"mapping to {value}" if isinstance(extra, dict) else "mapping"
        if isinstance(kind, list):
            return " or ".join(kind)
        text = kind or "any"
        bounds = [
            (">=", "minimum"),
            (">", "exclusiveMinimum"),
            ("<=", "maximum"),
            ("<", "exclusiveMaximum"),
        ]
        limits = [f"{op} {node[k]}" for op, k in bounds if k in node]
        if limits:
            text += " " + ", ".join(limits)
        if "pattern" in node:
            text += f" matching `{node['pattern']}`"
        return text

    def _title(self, name: str) -> str:
        return self.defs[name].get("title", name)

    # Page ------------------------------------------------------------------------------------

    def page(self) -> str:
        self.out.append(INTRO)
        self.out.append("## Top level {#top-level}\n")
        self.out.append(_escape(self.schema.get("description", ""), in_table=False) + "\n")
        self._table(self.schema)
        for key, prop in self.schema.get("properties", {}).items():
            refs = self._refs(prop)
            if len(refs) == 1:
                self._def(refs[0], key, level=2)
            elif refs:
                self.out.append(f"## `{key}` {{#{key}}}\n")
                self.out.append(_escape(prop.get("description", ""), in_table=False) + "\n")
                for ref in refs:
                    self._def(ref, key + ("[]" if "items" in prop else ""), level=3)
        return "\n".join(self.out)

    def _refs(self, node: Any) -> list[str]:
        """The models a field's type names, in order, each once."""
        found: list[str] = []

        def walk(n: Any) -> None:
            if not isinstance(n, dict):
                return
            if "$ref" in n:
                found.append(_ref_name(n))
                return
            for key in ("anyOf", "oneOf"):
                for sub in n.get(key, []):
                    walk(sub)
            walk(n.get("items"))
            walk(n.get("additionalProperties"))

        walk(node)
        return list(dict.fromkeys(found))

    def _def(self, name: str, path: str, level: int) -> None:
        if name in self.done:
            return
        self.done.add(name)
        node = self.defs[name]
        kind = node.get("properties", {}).get("kind", {}).get("const")
        label = f"`{path}` kind `{kind}`" if kind else f"`{path}`: {self._title(name)}"
        self.out.append(f"{'#' * level} {label} {{#{_anchor(name)}}}\n")
        if node.get("description"):
            self.out.append(_escape(node["description"], in_table=False) + "\n")
        others = [p for p in self.paths.get(name, []) if p != path]
        if others:
            self.out.append("Also at: " + ", ".join(f"`{p}`" for p in others) + ".\n")
        self._table(node)
        for key, prop in node.get("properties", {}).items():
            sub = f"{path}.{key}" + ("[]" if "items" in prop else "")
            for ref in self._refs(prop):
                self._def(ref, sub, level=min(level + 1, 4))

    def _table(self, node: dict[str, Any]) -> None:
        props = node.get("properties", {})
        if not props:
            return
        required = set(node.get("required", []))
        rows = ["| key | type | default | description |", "|---|---|---|---|"]
        for key, prop in props.items():
            if key in required:
                default = "required"
            elif "default" in prop:
                default = _value(prop["default"])
            elif (node.get("title"), key) in self.factory_defaults:
                default = _value(self.factory_defaults[(node["title"], key)])
            else:
                default = ""
            desc = _escape(prop.get("description", ""), in_table=True)
            rows.append(f"| `{key}` | {self.type_of(prop)} | {default} | {desc} |")
        self.out.append("\n".join(rows) + "\n")
