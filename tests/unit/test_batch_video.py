"""Video lines of a batch file (sdfarm.client.batch_video): typed and checked when the file is
read, with errors naming the line and the field; image paths relative to the batch file;
output names, the resume test and the files written for a video line."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from PIL import Image

from sdfarm.client.batch_input import BatchInputError, BatchItem, parse_items, read_items
from sdfarm.client.batch_output import output_name, split_done, write_result
from sdfarm.client.job import Result


def png(color: tuple[int, int, int] = (10, 200, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), color).save(buf, "PNG")
    return buf.getvalue()


def jsonl(*rows: dict) -> str:
    return "\n".join(json.dumps(r) for r in rows) + "\n"


def test_a_jsonl_video_line_is_typed_and_kept_apart_from_image_lines() -> None:
    image, video = parse_items(
        jsonl(
            {"prompt": "a kite", "strength": 0.5},
            {
                "prompt": "a cat",
                "kind": "video",
                "frames": 9,
                "fps": "8",
                "format": "webp",
                "seed": -1,
                "name": "cat",
            },
        ),  # fmt: skip
        "jsonl",
    )
    assert image.kind == "generate" and image.params == {"strength": 0.5}
    assert video.kind == "video" and video.name == "cat" and video.line == 2
    assert video.params == {"frames": 9, "fps": 8, "format": "webp", "seed": -1}
    # the command's flags: a video takes those a video has, not an image's own
    common = {"width": 64, "steps": 2, "strength": 0.7, "batch_count": 2}
    assert video.merged(common) == {"width": 64, "steps": 2, **video.params}
    assert image.merged(common) == {**common, "strength": 0.5}


@pytest.mark.parametrize(
    ("row", "words"),
    [
        ({"frames": 6}, ["line 2", "frames", "4k+1", "use 5 or 9"]),
        ({"width": 40}, ["line 2", "width", "multiple of 16"]),
        ({"fps": 0}, ["line 2", "fps", "outside"]),
        ({"format": "gif"}, ["line 2", "format", "webp, mp4"]),
        ({"frames": "many"}, ["line 2", "frames", "integer"]),
        ({"strength": 0.5}, ["line 2", "strength is not a field of a video line"]),
        ({"kind": "upscale"}, ["line 2", "kind must be one of generate, video"]),
        ({"kind": 3}, ["line 2", "kind"]),
    ],
)
def test_a_bad_video_line_is_refused_when_read_naming_line_and_field(
    row: dict, words: list[str]
) -> None:
    text = jsonl({"prompt": "ok"}, {"prompt": "x", "kind": "video", **row})
    with pytest.raises(BatchInputError) as err:
        parse_items(text, "jsonl")
    for word in words:
        assert word in str(err.value), (word, str(err.value))


def test_an_image_line_with_a_video_field_is_refused() -> None:
    with pytest.raises(BatchInputError, match="line 1: frames is not a field of a generate line"):
        parse_items(jsonl({"prompt": "x", "frames": 5}), "jsonl")
    with pytest.raises(BatchInputError, match=r"line 1: unknown fields \['colour'\]"):
        parse_items(jsonl({"prompt": "x", "kind": "video", "colour": 5}), "jsonl")


def test_csv_mixes_kinds_by_column_and_names_the_line_of_a_bad_cell() -> None:
    text = "prompt,kind,frames,format,strength,name\na kite,,,,0.4,kite\na cat,video,5,webp,,cat\n"
    kite, cat = parse_items(text, "csv")
    assert (kite.kind, kite.params) == ("generate", {"strength": 0.4})
    assert (cat.kind, cat.params) == ("video", {"frames": 5, "format": "webp"})
    bad = text + "a dog,video,5,,0.3,dog\n"
    with pytest.raises(BatchInputError, match="line 4: strength is not a field of a video line"):
        parse_items(bad, "csv")
    with pytest.raises(BatchInputError, match="line 2: invalid frames: 12 is not 4k"):
        parse_items("prompt,kind,frames\na cat,video,12\n", "csv")


def test_image_paths_are_relative_to_the_batch_file_and_must_exist(tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "first.png").write_bytes(png())
    batch = tmp_path / "jobs.jsonl"
    batch.write_text(
        jsonl({"prompt": "a cat", "kind": "video", "init_image": "in/first.png", "name": "c"})
    )
    (item,) = read_items(batch)
    assert item.params["init_image"] == str(tmp_path / "in" / "first.png")
    batch.write_text(
        jsonl(
            {"prompt": "a cat", "kind": "video", "name": "c"},
            {"prompt": "a dog", "kind": "video", "end_image": "in/last.png", "name": "d"},
        )
    )
    with pytest.raises(BatchInputError) as err:
        read_items(batch)
    message = str(err.value)
    assert "line 2: end_image: no image file 'in/last.png'" in message
    assert str(tmp_path) in message  # the folder the path is relative to


def test_a_video_line_s_output_is_its_video_file_and_that_is_the_resume_test() -> None:
    webp = BatchItem(0, "a", "a", {"frames": 5}, kind="video")
    mp4 = BatchItem(1, "b", "b", {"format": "mp4"}, kind="video")
    image = BatchItem(2, "c", "c")
    assert [output_name(i) for i in (webp, mp4, image)] == ["a.webp", "b.mp4", "c.png"]
    todo, skipped = split_done([webp, mp4, image], ["a.webp", "b.webp", "c.json"])
    assert todo == [mp4, image] and skipped == [webp]


def test_a_video_result_is_written_with_its_sidecar_and_frames_when_asked(tmp_path: Path) -> None:
    frames = [png((i * 50, 0, 0)) for i in range(3)]
    meta = {"kind": "video", "video_index": 3, "format": "webp"}
    result = Result("job1", [*frames, b"RIFF....WEBPVP8L"], meta)
    item = BatchItem(0, "a cat", "cat", {}, kind="video")
    target = write_result(tmp_path, item, "job1", result)
    assert target == tmp_path / "cat.webp" and target.read_bytes() == b"RIFF....WEBPVP8L"
    assert json.loads((tmp_path / "cat.json").read_text())["job"] == "job1"
    assert not (tmp_path / "cat").exists()  # frames only when asked
    write_result(tmp_path, item, "job1", result, frames=True)
    written = sorted(p.name for p in (tmp_path / "cat").iterdir())
    assert written == ["frame-0000.png", "frame-0001.png", "frame-0002.png"]
    assert (tmp_path / "cat" / "frame-0002.png").read_bytes() == frames[2]
    assert not list(tmp_path.rglob(".*.tmp"))
