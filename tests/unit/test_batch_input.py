"""Batch input: the three formats, output names and the resume decision (pure)."""

from __future__ import annotations

import pytest

from sdfarm.client.batch import Summary
from sdfarm.client.batch_input import (
    BatchInputError,
    BatchItem,
    decode_input,
    default_name,
    detect_format,
    parse_items,
    read_items,
    slugify,
)
from sdfarm.client.batch_output import split_done


def test_text_skips_blank_lines_and_comments_and_numbers_items_not_lines():
    items = parse_items("# header\n\na red kite\n   \n  # indented comment\nTwo Cats!\n", "text")
    assert [i.prompt for i in items] == ["a red kite", "Two Cats!"]
    assert [i.name for i in items] == ["00000-a-red-kite", "00001-two-cats"]
    assert [i.line for i in items] == [3, 6]
    assert all(i.params == {} for i in items)


def test_names_are_stable_and_readable():
    assert slugify("A cat -- in a HAT?") == "a-cat-in-a-hat"
    assert slugify("!!!") == "prompt"
    long = slugify("word " * 30)
    assert len(long) <= 40 and not long.endswith("-")
    assert default_name(7, "a fox") == "00007-a-fox"
    # Same input, same names: the basis of resuming.
    text = "a\nb\nc\n"
    assert [i.name for i in parse_items(text, "text")] == [
        i.name for i in parse_items(text, "text")
    ]


def test_csv_with_optional_fields_converted():
    text = (
        "prompt,negative_prompt,seed,width,height,steps,cfg_scale,sampler,name\n"
        "a kite,blurry,7,64,128,2,1.5,euler,kite\n"
        '"a cat, sitting",,,,,,,,\n'
    )
    first, second = parse_items(text, "csv")
    assert first.name == "kite"
    assert first.params == {
        "negative_prompt": "blurry",
        "seed": 7,
        "width": 64,
        "height": 128,
        "steps": 2,
        "cfg_scale": 1.5,
        "sampler": "euler",
    }
    assert second.prompt == "a cat, sitting" and second.params == {}
    assert second.name == "00001-a-cat-sitting"


def test_csv_prompt_only_and_errors():
    assert [i.prompt for i in parse_items("prompt\nx\n\ny\n", "csv")] == ["x", "y"]
    with pytest.raises(BatchInputError, match="no `prompt` column"):
        parse_items("text\nx\n", "csv")
    with pytest.raises(BatchInputError, match="unknown CSV columns"):
        parse_items("prompt,colour\nx,red\n", "csv")
    with pytest.raises(BatchInputError, match="line 3: steps must be an integer"):
        parse_items("prompt,steps\nx,1\ny,many\n", "csv")


def test_jsonl_objects_and_errors():
    text = '{"prompt": "a", "seed": 3, "name": "first"}\n\n{"prompt": "b", "width": 64.0}\n'
    a, b = parse_items(text, "jsonl")
    assert (a.name, a.params) == ("first", {"seed": 3})
    assert (b.name, b.params) == ("00001-b", {"width": 64})
    with pytest.raises(BatchInputError, match="line 2: not JSON"):
        parse_items('{"prompt": "a"}\n{oops\n', "jsonl")
    with pytest.raises(BatchInputError, match="line 1: expected a JSON object"):
        parse_items('["a"]\n', "jsonl")
    with pytest.raises(BatchInputError, match="line 1: no prompt"):
        parse_items('{"seed": 1}\n', "jsonl")
    with pytest.raises(BatchInputError, match="unknown fields"):
        parse_items('{"prompt": "a", "model": "x"}\n', "jsonl")
    with pytest.raises(BatchInputError, match="seed must be an integer"):
        parse_items('{"prompt": "a", "seed": 1.5}\n', "jsonl")
    with pytest.raises(BatchInputError, match="must be a number"):
        parse_items('{"prompt": "a", "cfg_scale": true}\n', "jsonl")


@pytest.mark.parametrize("name", ["../escape", "a/b", ".hidden", "x.png", "", "sp ace"])
def test_names_must_be_plain_file_names(name):
    if name == "":
        assert parse_items('{"prompt": "a", "name": ""}\n', "jsonl")[0].name == "00000-a"
        return
    with pytest.raises(BatchInputError, match="not a plain file name"):
        parse_items(f'{{"prompt": "a", "name": "{name}"}}\n', "jsonl")


def test_duplicate_names_are_refused():
    with pytest.raises(BatchInputError, match="line 2: name 'x' already used on line 1"):
        parse_items('{"prompt": "a", "name": "x"}\n{"prompt": "b", "name": "x"}\n', "jsonl")


def test_format_from_extension():
    assert detect_format("p.jsonl") == "jsonl"
    assert detect_format("p.NDJSON") == "jsonl"
    assert detect_format("p.csv") == "csv"
    assert detect_format("p.txt") == "text"
    assert detect_format("prompts") == "text"
    with pytest.raises(BatchInputError, match="unknown format"):
        parse_items("x", "yaml")


def test_resume_skips_exactly_the_items_whose_png_exists():
    items = parse_items("a\nb\nc\n", "text")
    existing = {"00000-a.png", "00001-b.json", "00002-c.png.tmp", "unrelated.png"}
    todo, skipped = split_done(items, existing)
    # b has only its sidecar (the PNG comes last), c only a temporary file: both redone.
    assert [i.name for i in todo] == ["00001-b", "00002-c"]
    assert [i.name for i in skipped] == ["00000-a"]
    todo, skipped = split_done(items, {f"{i.name}.png" for i in items})
    assert todo == [] and len(skipped) == 3


def test_item_fields_override_the_command_flags():
    item = BatchItem(0, "a", "n", {"seed": 1})
    assert item.merged({"seed": 9, "steps": 2}) == {"seed": 1, "steps": 2}


def test_summary_document():
    s = Summary(total=3, done=2, skipped=0, submitted=3, total_s=2.0, render_s=1.0, out="o")
    s.failures.append({"name": "x", "index": 2, "error": "GenerationError: boom"})
    doc = s.to_dict()
    assert doc["failed"] == 1 and doc["images_per_s"] == 2.0 and doc["done"] == 2
    assert "failed x: GenerationError: boom" in s.text()


# -- reading the file: encoding and strict CSV ---------------------------------------------------


def test_invalid_utf8_names_the_line_and_the_byte_offset(tmp_path):
    data = b"a kite\nb caf\xc3\xa9\nthird \xff line\n"
    with pytest.raises(BatchInputError) as info:
        decode_input(data)
    message = str(info.value)
    assert message.startswith("line 3: not valid UTF-8")
    assert "byte 0xff at byte offset 21 of the file, byte 7 of the line" in message
    assert data[21:22] == b"\xff"
    path = tmp_path / "p.txt"
    path.write_bytes(data)
    with pytest.raises(BatchInputError, match="line 3: not valid UTF-8"):
        read_items(path)
    # A byte order mark is dropped and counted; a cut multi-byte character is found too.
    with pytest.raises(BatchInputError, match=r"line 1: .*byte offset 5 of the file"):
        decode_input(b"\xef\xbb\xbfab\xe2\x82")


def test_utf8_with_a_bom_and_any_line_ends_reads_as_before(tmp_path):
    path = tmp_path / "p.csv"
    path.write_bytes(b"\xef\xbb\xbfprompt,seed\r\ncaf\xc3\xa9,1\rb,2\n")
    assert [(i.prompt, i.params, i.line) for i in read_items(path)] == [
        ("café", {"seed": 1}, 2),
        ("b", {"seed": 2}, 3),
    ]
    # Text and JSONL lines are split on line ends only: U+2028 stays inside its line.
    jsonl = '{"prompt": "a\u2028b"}\n{"prompt": "c"}\n'
    assert [(i.prompt, i.line) for i in parse_items(jsonl, "jsonl")] == [("a\u2028b", 1), ("c", 2)]


def test_an_unterminated_csv_quote_names_the_line_where_it_starts():
    text = 'prompt,seed\na kite,1\n"a cat, sitting,2\nb dog,3\nc owl,4\n'
    with pytest.raises(BatchInputError) as info:
        parse_items(text, "csv")
    assert str(info.value).startswith("line 3: a quoted field starts on this line and is not")
    # At the end of the file (no newline), and in a later column.
    with pytest.raises(BatchInputError, match="line 2: a quoted field starts"):
        parse_items('prompt,negative_prompt\nx,"blurry', "csv")
    # A quote that a later line happens to close never merges the lines in between.
    with pytest.raises(BatchInputError, match="line 2: a quoted field starts"):
        parse_items('prompt,seed\n"a cat,1\nb dog,2\nc" owl,3\n', "csv")


def test_strict_csv_refuses_stray_quotes_and_extra_values():
    with pytest.raises(BatchInputError, match=r"line 2: malformed CSV \(',' expected after"):
        parse_items('prompt\n"a "b" c\n', "csv")
    with pytest.raises(BatchInputError, match="line 3: 2 values but 1 columns; quote a value"):
        parse_items("prompt\nfine\na cat, sitting\n", "csv")
    with pytest.raises(BatchInputError, match=r"line 1: CSV columns \['seed'\] appear more"):
        parse_items("prompt,seed,seed\nx,1,2\n", "csv")
    # Still fine: quoted commas, an empty trailing value, comments (even with a quote in them).
    text = '# don\'t "quote me\nprompt,seed\n"a cat, sitting",\n# "x\n\nb,2,\n'
    items = parse_items(text, "csv")
    assert [(i.prompt, i.params, i.line) for i in items] == [
        ("a cat, sitting", {}, 3),
        ("b", {"seed": 2}, 6),
    ]


@pytest.mark.parametrize("value", ["0", "-3", "x", "1.5"])
def test_the_in_flight_flag_is_a_whole_number_of_at_least_one(value):
    import argparse

    from sdfarm.cli.batch import in_flight_type

    assert in_flight_type("1") == 1 and in_flight_type("64") == 64
    with pytest.raises(argparse.ArgumentTypeError, match="1 or more"):
        in_flight_type(value)


# -- streaming a file ------------------------------------------------------------------------------


def test_a_file_is_streamed_and_scanned_without_being_held(tmp_path):
    from sdfarm.client.batch_input import iter_items, scan_items

    path = tmp_path / "p.jsonl"
    lines = [f'{{"prompt": "p{i}", "name": "n{i}"}}' for i in range(2000)]
    lines[1500] = '{"prompt": "dup", "name": "n7"}'
    path.write_text("\n".join(lines) + "\n")
    stream = iter_items(path)
    assert next(stream).name == "n0"  # a generator: the first item before the rest is parsed
    with pytest.raises(BatchInputError, match="line 1501: name 'n7' already used on line 8"):
        scan_items(path)
    lines[1500] = "not json"
    path.write_text("\n".join(lines) + "\n")
    assert [next(iter_items(path)).name] == ["n0"]  # lazily: the bad line is not reached
    with pytest.raises(BatchInputError, match="line 1501: not JSON"):
        scan_items(path)
    lines[1500] = '{"prompt": "fine"}'
    path.write_text("\n".join(lines) + "\n")
    scan = scan_items(path, todo=lambda item: item.index % 2 == 0)
    assert (scan.total, scan.todo) == (2000, 1000)
    assert [i.name for i in iter_items(path)][1500] == "01500-fine"
