"""Each job-spec option is described once, in its field's Meta (schemas/job.py), and
docs/job-spec.md's options table is generated from those fields (schemas/options.py)."""

from pathlib import Path

import msgspec
import pytest

from opentinker.schemas.job import Bounded, Doc, JobSpec, SamplingParams, SpecError, spec_from_dict
from opentinker.schemas.options import BEGIN, COMMAND, END, main, options, options_table, undocumented, with_table

PAGE = Path(__file__).resolve().parents[2] / "docs" / "job-spec.md"


def test_the_docs_options_table_is_the_one_the_fields_make():
    page = PAGE.read_text()
    assert page.count(BEGIN) == 1 and page.count(END) == 1
    assert with_table(page, options_table()) == page, f"docs/job-spec.md's options table is stale: run `{COMMAND}`"


def test_every_jobspec_and_sampling_field_is_an_option_with_a_description():
    names = [o.name for o in options()]
    fields = [n for n in msgspec.structs.fields(JobSpec) if n.name != "schema_version"]
    assert names == [n for f in fields for n in
                     ([f.name] + [f"{f.name}.{g.name}" for g in msgspec.structs.fields(SamplingParams)]
                      if f.name == "sampling" else [f.name])]
    assert undocumented() == []
    assert all(len(o.doc.strip()) > 10 for o in options())


def test_an_option_added_without_a_description_fails_the_table():
    class Inner(msgspec.Struct, frozen=True, kw_only=True):
        known: Bounded(int, 0, 3, doc="A documented number.") = 1
        bare: float = 0.5

    class Grown(JobSpec, frozen=True, kw_only=True):
        extra: int = 0
        limited: Bounded(int, 0, 9) = 2
        nested: Doc(Inner, "A nested table.") = msgspec.field(default_factory=Inner)

    assert undocumented(Grown) == ["extra", "limited", "nested.bare"]
    with pytest.raises(ValueError, match=r"\['extra', 'limited', 'nested.bare'\]"):
        options_table(Grown)


def test_a_row_shows_the_type_or_choices_default_and_bounds():
    rows = {o.name: (o.kind, o.default, o.bounds) for o in options()}
    assert rows["sampling.top_p"] == ("float", "1.0", "(0, 1]")
    assert rows["lr"] == ("float", "0.0005", "(0, 1)")
    assert rows["engine"] == ('`"auto"`, `"vllm"`, `"hf"`', '"auto"', "")  # declaration order
    assert rows["lora_target_modules"] == ("array of strings", '["q_proj", "v_proj"]', "")
    assert rows["opponents"] == ("table of strings", "{}", "")
    assert rows["skip_zero_variance"] == ("boolean", "true", "")
    assert rows["sampling"] == ("table", "", "")
    table = options_table()
    # a cell's | is escaped
    assert "| `dual_clip` | float | `0.0` | [0, 100] | c > 1 bounds a negative-advantage token's loss by c \\|A\\|" \
        in table


def test_a_refused_number_quotes_its_description():
    with pytest.raises(SpecError) as e:
        spec_from_dict({"max_staleness": 17})
    assert e.value.field == "max_staleness"
    assert "must be in [0, 16] (got 17): " in e.value.reason and "strictly on-policy" in e.value.reason


def test_the_command_writes_the_table_between_the_markers_and_checks_it(tmp_path, capsys):
    page = tmp_path / "page.md"
    page.write_text(f"# Title\n\nprose\n\n{BEGIN}\nold table\n{END}\n\nmore prose\n")
    main(["--write", str(page)])
    assert capsys.readouterr().out == f"wrote the table of {len(options())} options into {page}\n"
    text = page.read_text()
    assert text.startswith("# Title\n\nprose\n\n") and text.endswith(f"{END}\n\nmore prose\n")
    assert "old table" not in text and "| `sampling.max_turns` | integer | `1` | [1, 1024] |" in text
    main(["--check", str(page)])
    page.write_text(text.replace("| `seed` |", "| `seed2` |"))
    with pytest.raises(SystemExit, match="stale"):
        main(["--check", str(page)])
    page.write_text("no markers\n")
    with pytest.raises(ValueError, match="no <!-- options --> ... <!-- /options --> markers"):
        main(["--write", str(page)])
    main([])
    assert capsys.readouterr().out.startswith("Generated from the fields of `schemas/job.py`")
