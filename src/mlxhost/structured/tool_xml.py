"""Grammar rules for Qwen3-Coder's XML tool calls (the `qwen3_coder` tool parser reads them back):

    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>

A value is raw text: strings as they are (up to the first closing tag), everything else as JSON, which the
parser converts by the parameter's schema type. Parameters come in the schema's `properties` order,
required ones always, optional ones may be left out, others not at all.
"""

from __future__ import annotations

from mlxhost.structured.lark_rules import ConstraintError, json_subgrammar, lit

CLOSE = "\n</parameter>\n"
_STRUCTURE = ("properties", "items", "anyOf", "oneOf", "allOf", "$ref", "enum", "const")


def xml_call_rules(index: int, tool: str, params: dict, strict: bool) -> tuple[list[str], list[dict]]:
    """The Lark rules of `call_<index>` (one call of `tool`) and the JSON sub-grammars its values use."""
    props = params.get("properties") or {}
    if not isinstance(props, dict):
        raise ConstraintError(f"parameters of tool {tool!r}: properties must be an object")
    required = set(params.get("required") or ())
    defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
    rules, subs, parts = [], [], []
    for j, (name, schema) in enumerate(props.items()):
        rule, value = f"param_{index}_{j}", f"value_{index}_{j}"
        schema = schema if isinstance(schema, dict) else {}
        rules.append(f"{rule}: {lit(f'<parameter={name}>' + chr(10))} {value}")
        strings = _strings(schema)
        if strings is not None:  # a fixed choice of strings, each closed by the tag
            rules.append(f"{value}: " + " | ".join(lit(s + CLOSE) for s in strings))
        elif _is_text(schema):  # raw text: a lazy lexeme that ends at the first closing tag
            rules.append(f"{value}[lazy]: XML_TEXT {lit(CLOSE)}")
        else:
            sub = f"json_{index}_{j}"
            subs.append(json_subgrammar({**schema, **defs}, strict, sub, f"parameter {name!r} of tool {tool!r}"))
            rules.append(f"{value}: @{sub} {lit(CLOSE)}")
        parts.append(rule if name in required else f"{rule}?")
    body = " ".join([lit(f"<function={tool}>\n"), *parts, '"</function>"'])
    return [f"call_{index}: {body}", *rules], subs


def xml_rules() -> list[str]:
    return [r"XML_TEXT: /(.|\n)*/"]


def _strings(schema: dict) -> list[str] | None:
    """The allowed values of a string parameter limited to an enum or a const, else None."""
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if values and all(isinstance(v, str) for v in values):
        return list(dict.fromkeys(values))
    return None


def _is_text(schema: dict) -> bool:
    """Written as raw text: strings, and values with no type or structure to hold them to (the parser
    keeps those as text too)."""
    kind = schema.get("type")
    if isinstance(kind, list):
        return "string" in kind
    if kind is not None:
        return kind == "string"
    return not any(k in schema for k in _STRUCTURE)
