"""The job spec's options as a Markdown table, read off the JobSpec fields: dotted name,
type or choices, default, bounds and description (each field's msgspec Meta, schemas/job.py).
docs/job-spec.md holds the table between its `<!-- options -->` and `<!-- /options -->` lines.

    .venv/bin/python -m opentinker.schemas.options                                # print the table
    .venv/bin/python -m opentinker.schemas.options --write docs/job-spec.md       # rewrite the page's table
    .venv/bin/python -m opentinker.schemas.options --check docs/job-spec.md       # exit 1 if it is stale

tests/unit/test_spec_options.py fails until the page holds the table of the current
fields. Standard library and msgspec only.
"""

from __future__ import annotations

import argparse
import json
import typing
from pathlib import Path
from typing import Annotated, Any, NamedTuple

import msgspec

from opentinker.schemas.base import Message
from opentinker.schemas.job import JobSpec, struct_ranges

# the page's markers, as the README's generated tables have them (bench/main_job_seeds.py)
BEGIN = "<!-- options -->"
END = "<!-- /options -->"
COMMAND = ".venv/bin/python -m opentinker.schemas.options --write docs/job-spec.md"
# the fields every bus message has (schema_version): the wire's, not options
WIRE_FIELDS = frozenset(f.name for f in msgspec.structs.fields(Message))


class Option(NamedTuple):
    """One row of the table: `name` dotted ("sampling.temperature"), `kind` the type or
    the choices, `default` as TOML writes it ("" for a nested table), `bounds` as
    "[lo, hi]" ("" where the field has none), `doc` the description ("" when missing)."""

    name: str
    kind: str
    default: str
    bounds: str
    doc: str


def _toml(x: Any) -> str:
    """`x` as a TOML value."""
    if isinstance(x, bool):
        return "true" if x else "false"
    if isinstance(x, str):
        return json.dumps(x)
    if isinstance(x, list):
        return "[" + ", ".join(_toml(v) for v in x) + "]"
    if isinstance(x, dict):
        return "{ " + ", ".join(f"{k} = {_toml(v)}" for k, v in x.items()) + " }" if x else "{}"
    return repr(x)


_KINDS = {msgspec.inspect.IntType: "integer", msgspec.inspect.FloatType: "float", msgspec.inspect.StrType: "string",
          msgspec.inspect.BoolType: "boolean", msgspec.inspect.AnyType: "any", msgspec.inspect.StructType: "table"}


def _kind(t: msgspec.inspect.Type, hint: Any) -> str:
    """The type of a field as TOML names it, or its choices in declaration order (`hint`,
    the annotation, keeps it; msgspec sorts them)."""
    if isinstance(t, msgspec.inspect.LiteralType):
        while typing.get_origin(hint) is Annotated:
            hint = typing.get_args(hint)[0]
        return ", ".join(f"`{_toml(v)}`" for v in typing.get_args(hint))
    if isinstance(t, msgspec.inspect.ListType):
        return f"array of {_kind(t.item_type, None)}s"
    if isinstance(t, msgspec.inspect.DictType):
        any_value = isinstance(t.value_type, msgspec.inspect.AnyType)
        return "table" if any_value else f"table of {_kind(t.value_type, None)}s"
    return _KINDS.get(type(t), type(t).__name__)


def options(struct: type = JobSpec, prefix: str = "") -> list[Option]:
    """Every option of `struct` in declaration order, a nested struct's row followed by
    its own options (dotted), the wire's fields (schema_version) left out."""
    ranges = struct_ranges(struct, prefix)
    hints = typing.get_type_hints(struct, include_extras=True)
    rows: list[Option] = []
    for f in msgspec.inspect.type_info(struct).fields:
        if f.name in WIRE_FIELDS:
            continue
        t, doc = f.type, ""
        if isinstance(t, msgspec.inspect.Metadata):
            t, doc = t.type, (t.extra_json_schema or {}).get("description", "")
        name = prefix + f.name
        if isinstance(t, msgspec.inspect.StructType):
            rows.append(Option(name, "table", "", "", doc))
            rows.extend(options(t.cls, f"{name}."))
            continue
        default = f.default if f.default_factory is msgspec.NODEFAULT else f.default_factory()
        r = ranges.get(name)
        rows.append(Option(name, _kind(t, hints[f.name]), _toml(default), str(r) if r else "", doc))
    return rows


def undocumented(struct: type = JobSpec) -> list[str]:
    """The dotted names of the options of `struct` without a description."""
    return [o.name for o in options(struct) if not o.doc.strip()]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def options_table(struct: type = JobSpec) -> str:
    """The Markdown table of every option of `struct`, with a line naming how it is made.

    Raises ValueError naming the options that have no description."""
    missing = undocumented(struct)
    if missing:
        raise ValueError(f"options without a description (Doc / Bounded(doc=...) in schemas/job.py): {missing}")
    lines = [f"Generated from the fields of `schemas/job.py` by `{COMMAND}`: edit a description there, then "
             "rerun.", "", "| option | type | default | bounds | description |", "|---|---|---|---|---|"]
    lines += [f"| `{o.name}` | {_cell(o.kind)} | {f'`{_cell(o.default)}`' if o.default else ''} | {o.bounds} | "
              f"{_cell(o.doc)} |" for o in options(struct)]
    return "\n".join(lines) + "\n"


def with_table(page: str, table: str, marker: str = "options") -> str:
    """`page` with what stands between its `<!-- marker -->` and `<!-- /marker -->` lines
    (BEGIN and END for the default) replaced by `table`.

    Raises ValueError when the page lacks either marker or has them out of order."""
    begin, end = f"<!-- {marker} -->", f"<!-- /{marker} -->"
    start, stop = page.find(begin), page.find(end)
    if start < 0 or stop < start:
        raise ValueError(f"no {begin} ... {end} markers to write between")
    return page[:start + len(begin)] + "\n" + table + page[stop:]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m opentinker.schemas.options", description=__doc__.split("\n\n")[0])
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--write", metavar="PAGE", type=Path, help="replace the table between the markers of PAGE")
    group.add_argument("--check", metavar="PAGE", type=Path, help="exit 1 if PAGE's table is not the current one")
    args = ap.parse_args(argv)
    table = options_table()
    if args.write is None and args.check is None:
        print(table, end="")
        return
    path = args.write or args.check
    page = path.read_text()
    text = with_table(page, table)
    if args.check:
        if text != page:
            raise SystemExit(f"{path}: the options table is stale: run `{COMMAND}`")
        return
    path.write_text(text)
    print(f"wrote the table of {len(options())} options into {path}")


if __name__ == "__main__":
    main()
