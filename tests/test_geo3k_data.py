"""geo3k data: synthetic diagrams are deterministic and correct, the real shape loads, bad files
get one sentence."""

import base64
import io
import json
import math
import subprocess
import sys

import pyarrow
import pyarrow.parquet
import pytest
from PIL import Image

from workbench.api import is_equivalent, load_plugin

geo3k_data = load_plugin("geo3k_data")


@pytest.fixture(scope="module")
def synthetic():
    return geo3k_data.make_dataset(60, seed=3)


def png(color: str, size=(20, 10)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return buffer.getvalue()


# ---- synthetic -----------------------------------------------------------------------------------


def test_the_same_seed_gives_byte_identical_samples_and_another_seed_others(synthetic):
    again = geo3k_data.make_dataset(60, seed=3)
    # images included, byte for byte
    assert again == synthetic
    other = geo3k_data.make_dataset(60, seed=4)
    assert [s["images"] for s in other] != [s["images"] for s in synthetic]
    assert [s["answer"] for s in other] != [s["answer"] for s in synthetic]
    assert geo3k_data.make_dataset(5, seed=3) == synthetic[:5]


def expected_value(kind: str, values: dict) -> float:
    """Each kind's answer recomputed from the drawn values, numerically (independent of the
    plugin's formatting)."""
    if kind == "triangle_angle":
        return 180 - values["a"] - values["b"]
    if kind == "right_triangle":
        return math.hypot(values["a"], values["b"])
    if kind == "circle" and values["asked"] == "area":
        return math.pi * values["r"] ** 2
    if kind == "circle":
        return 2 * math.pi * values["r"]
    if kind == "parallel_lines" and values["relation"] == "same-side interior":
        return 180 - values["g"]
    if kind == "parallel_lines":
        return values["g"]
    if kind == "rectangle" and values["asked"] == "area":
        return values["w"] * values["h"]
    if kind == "rectangle":
        return 2 * (values["w"] + values["h"])
    raise AssertionError(kind)


def test_every_answer_is_what_the_drawn_values_give(synthetic):
    assert {s["kind"] for s in synthetic} == set(geo3k_data.KINDS)
    for sample in synthetic:
        assert is_equivalent(
            sample["answer"], repr(expected_value(sample["kind"], sample["values"]))
        ), sample
        assert all(0 < value < 200 for value in sample["values"].values() if isinstance(value, int))


def test_answers_use_natural_notation():
    answers = {s["answer"] for s in geo3k_data.make_dataset(200, seed=0)}
    assert any(a.endswith("\\pi") for a in answers) and any("\\sqrt{" in a for a in answers)
    assert all(a.lstrip("-").isdigit() or "\\pi" in a or "\\sqrt{" in a for a in answers)
    assert "1\\pi" not in answers and not any(a.startswith("1\\sqrt") for a in answers)


def test_four_distinct_choices_exactly_one_of_them_right(synthetic):
    for sample in synthetic:
        choices = sample["choices"]
        assert len(choices) == 4 and len(set(choices)) == 4 and sample["answer"] in choices
        assert sum(is_equivalent(choice, sample["answer"]) for choice in choices) == 1, sample
    positions = {s["choices"].index(s["answer"]) for s in synthetic}
    # the right answer is not always in one place
    assert positions == {0, 1, 2, 3}


def test_images_are_112_pixel_rgb_pngs_with_a_drawing(synthetic):
    for sample in synthetic:
        (data,) = sample["images"]
        assert data.startswith(b"\x89PNG\r\n\x1a\n")
        image = Image.open(io.BytesIO(data))
        assert (image.format, image.mode, image.size) == ("PNG", "RGB", (112, 112))
        dark = sum(image.convert("L").histogram()[:128])
        assert 300 < dark < 1500, sample["id"]  # lines and labels on a white ground


def test_the_problem_text_states_the_given_values(synthetic):
    for sample in synthetic:
        problem = sample["problem"]
        values = sample["values"]
        assert problem.startswith("<image>") and problem.count("<image>") == 1
        for value in values.values():
            assert str(value) in problem, (value, problem)
    assert len({s["id"] for s in synthetic}) == len(synthetic)


def test_the_single_turn_env_grades_a_reply_with_the_geo3k_reward(synthetic):
    env = geo3k_data.AgentRunner()
    sample = synthetic[0]
    assert env.reset(sample) == sample["problem"]
    right = env.step(f"From the diagram the value follows. \\boxed{{{sample['answer']}}}")
    assert right.reward == pytest.approx(1.0) and right.terminated and right.info["accuracy"] == 1.0
    letter = "ABCD"[sample["choices"].index(sample["answer"])]
    assert env.step(f"It is choice {letter}. \\boxed{{{letter}}}").reward == pytest.approx(1.0)
    wrong = next(c for c in sample["choices"] if c != sample["answer"])
    assert env.step(f"I guess. \\boxed{{{wrong}}}").reward == pytest.approx(0.1)


# ---- the real shape ------------------------------------------------------------------------------

IMAGE_STRUCT = pyarrow.list_(
    pyarrow.struct([("bytes", pyarrow.binary()), ("path", pyarrow.string())])
)


def write_hiyouga_parquet(path, rows):
    """The hiyouga/geometry3k layout: images as a list of {"bytes", "path"} structs, problem,
    answer."""
    schema = pyarrow.schema(
        [("images", IMAGE_STRUCT), ("problem", pyarrow.string()), ("answer", pyarrow.string())]
    )
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows, schema=schema), path)


def test_a_hiyouga_parquet_loads_into_samples(tmp_path):
    red = png("red")
    blue = png("blue")
    write_hiyouga_parquet(
        tmp_path / "train.parquet",
        [
            {
                "images": [{"bytes": red, "path": "0.png"}],
                "problem": "<image>Find x.",
                "answer": "2\\sqrt{221}",
            },
            {
                "images": [{"bytes": blue, "path": None}],
                "problem": "Find the area.",
                "answer": "25\\pi",
            },
        ],
    )
    samples = geo3k_data.load_dataset(tmp_path / "train.parquet")
    assert samples == [
        {
            "id": "0",
            "problem": "<image>Find x.",
            "answer": "2\\sqrt{221}",
            "images": [red],
            "choices": None,
            "kind": "geo3k",
        },
        {
            "id": "1",
            "problem": "<image>Find the area.",
            "answer": "25\\pi",
            "images": [blue],
            "choices": None,
            "kind": "geo3k",
        },
    ]


def test_a_jsonl_with_base64_images_file_paths_letters_and_ground_truth_loads(tmp_path):
    red = png("red")
    blue = png("blue")
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "7.png").write_bytes(blue)
    rows = [
        {
            "id": 41,
            "images": [base64.b64encode(red).decode()],
            "problem": "<image>Find x.",
            "answer": "B",
            "choices": ["3", "4", "5", "6"],
        },
        {"images": ["img/7.png"], "problem": "<image>Find y.", "ground_truth": "12"},
        {
            "images": ["data:image/png;base64," + base64.b64encode(red).decode()],
            "problem": "<image>Find z.",
            "answer": "1",
        },
    ]
    (tmp_path / "data.jsonl").write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    samples = geo3k_data.load_dataset(tmp_path / "data.jsonl")
    assert [s["id"] for s in samples] == ["41", "1", "2"]
    # the letter became its value
    assert samples[0]["answer"] == "4" and samples[0]["choices"] == ["3", "4", "5", "6"]
    assert [s["images"] for s in samples] == [[red], [blue], [red]]
    assert samples[1]["answer"] == "12"


def sentence_of(path) -> str:
    with pytest.raises(ValueError) as raised:
        geo3k_data.load_dataset(path)
    message = str(raised.value)
    assert message.count(". ") == 0 and message.endswith("."), message  # one sentence
    return message


def test_bad_files_are_refused_with_one_sentence_naming_problem_and_fix(tmp_path):
    message = sentence_of(tmp_path / "missing.parquet")
    assert "missing.parquet does not exist" in message and "molt-wb prepare geo3k" in message

    pyarrow.parquet.write_table(
        pyarrow.table({"question": ["Find x."], "label": ["3"]}), tmp_path / "cols.parquet"
    )
    message = sentence_of(tmp_path / "cols.parquet")
    assert (
        "has no images, problem, answer column" in message
        and "needs images, problem and answer" in message
    )

    write_hiyouga_parquet(
        tmp_path / "broken.parquet",
        [
            {
                "images": [{"bytes": png("red"), "path": None}],
                "problem": "<image>ok",
                "answer": "1",
            },
            {
                "images": [{"bytes": b"not an image at all", "path": None}],
                "problem": "<image>bad",
                "answer": "2",
            },
        ],
    )
    message = sentence_of(tmp_path / "broken.parquet")
    assert (
        "row 1" in message
        and "image 0 cannot be opened" in message
        and "fix or drop that row" in message
    )

    write_hiyouga_parquet(tmp_path / "empty.parquet", [])
    assert "has no rows" in sentence_of(tmp_path / "empty.parquet")
    (tmp_path / "empty.jsonl").write_text("\n")
    assert "has no rows" in sentence_of(tmp_path / "empty.jsonl")

    (tmp_path / "gone.jsonl").write_text(
        json.dumps({"images": ["nowhere.png"], "problem": "p", "answer": "1"}) + "\n"
    )
    message = sentence_of(tmp_path / "gone.jsonl")
    assert "row 0" in message and "cannot be opened" in message and "nowhere.png" in message

    (tmp_path / "nulls.jsonl").write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"images": [base64.b64encode(png("red")).decode()], "problem": "p", "answer": "1"},
                {"id": "q7", "images": [base64.b64encode(png("red")).decode()], "problem": "p"},
            ]
        )
        + "\n"
    )
    assert "row 1 (id q7) has no answer" in sentence_of(tmp_path / "nulls.jsonl")

    (tmp_path / "bad.jsonl").write_text("{not json\n")
    assert "is not JSON lines" in sentence_of(tmp_path / "bad.jsonl")
    (tmp_path / "data.csv").write_text("a,b\n")
    assert "unknown format" in sentence_of(tmp_path / "data.csv")


# ---- prepare -------------------------------------------------------------------------------------


def write_release_split(folder, problems):
    """The original Geometry3K release: <split>/<id>/data.json and img_diagram.png."""
    for pid, (text, choices, letter, image) in problems.items():
        (folder / str(pid)).mkdir(parents=True)
        (folder / str(pid) / "img_diagram.png").write_bytes(image)
        (folder / str(pid) / "data.json").write_text(
            json.dumps(
                {
                    "id": pid,
                    "problem_text": text,
                    "choices": choices,
                    "answer": letter,
                    "precise_value": [0, 0, 0, 0],
                    "problem_type_graph": ["Triangle"],
                    "problem_type_goal": ["Angle"],
                    "data_type": folder.name,
                }
            )
        )


PROBLEMS = {
    2: ("Find x.", ["30", "45", "60", "75"], "C", png("red")),
    10: (
        "Find the area of the circle.",
        ["4\\pi", "8\\pi", "16\\pi", "2\\pi"],
        "A",
        png("blue", (30, 30)),
    ),
}


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_prepare_converts_a_release_split_and_the_result_loads_back(tmp_path, suffix):
    write_release_split(tmp_path / "geometry3k" / "train", PROBLEMS)
    out = tmp_path / f"out{suffix}"
    assert geo3k_data.prepare(tmp_path / "geometry3k" / "train", out) == 2
    samples = geo3k_data.load_dataset(out)
    assert [(s["id"], s["problem"], s["answer"], s["choices"], s["images"]) for s in samples] == [
        ("2", "<image>Find x.", "60", PROBLEMS[2][1], [PROBLEMS[2][3]]),
        ("10", "<image>Find the area of the circle.", "4\\pi", PROBLEMS[10][1], [PROBLEMS[10][3]]),
    ]
    # Parquet <-> JSONL round trip
    other_suffix = ".jsonl" if suffix == ".parquet" else ".parquet"
    again = tmp_path / f"again{other_suffix}"
    assert geo3k_data.prepare(out, again) == 2 and geo3k_data.load_dataset(again) == samples


def test_prepare_round_trips_the_synthetic_set_and_refuses_mixed_splits(tmp_path, synthetic):
    geo3k_data.save_dataset(synthetic[:10], tmp_path / "synthetic.parquet")
    loaded = geo3k_data.load_dataset(tmp_path / "synthetic.parquet")
    expected = []
    for sample in synthetic[:10]:
        expected.append({k: v for k, v in sample.items() if k != "values"})
    assert loaded == expected

    write_release_split(tmp_path / "release" / "train", PROBLEMS)
    write_release_split(tmp_path / "release" / "test", PROBLEMS)
    with pytest.raises(
        ValueError, match=r"holds several splits \(train, test\): give one split folder"
    ):
        geo3k_data.prepare(tmp_path / "release", tmp_path / "out.jsonl")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no <id>/data.json"):
        geo3k_data.prepare(tmp_path / "empty", tmp_path / "out.jsonl")
    with pytest.raises(ValueError, match="name it .parquet or .jsonl"):
        geo3k_data.prepare(tmp_path / "release" / "train", tmp_path / "out.txt")


def test_the_cli_prepares_geo3k_and_refuses_bad_input_in_one_line(tmp_path):
    write_release_split(tmp_path / "train", PROBLEMS)
    cli = [sys.executable, "-m", "workbench.cli", "prepare", "geo3k"]
    result = subprocess.run(
        [*cli, str(tmp_path / "train"), str(tmp_path / "out.parquet")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"wrote 2 samples to {tmp_path / 'out.parquet'}"
    assert [s["answer"] for s in geo3k_data.load_dataset(tmp_path / "out.parquet")] == [
        "60",
        "4\\pi",
    ]
    result = subprocess.run(
        [*cli, str(tmp_path / "nowhere"), str(tmp_path / "out.parquet")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == (
        f"error: {tmp_path / 'nowhere'} does not exist: "
        "give a split folder of the Geometry3K release or a .parquet/.jsonl file."
    )
