"""Geometry3K-shaped data: a synthetic set drawn with PIL, the real set's loader, and its converter.

Every sample is {"id", "problem" ("<image>..."), "answer" (a string: "70", "25\\pi", "5\\sqrt{2}"),
"images" (PNG/JPEG bytes), "choices" (4 strings, one of them the answer), "kind"}; synthetic ones
also keep the drawn "values" the answer is computed from. A synthetic diagram is drawn to scale on
112×112 pixels and its problem text also states the given values in words (as the real set often
does), so a model that cannot read pixels can still solve it. The same seed gives byte-identical
samples.

As an agent plugin (`agent.plugin=geo3k_data`) it is the single-turn, tool-free Env: the reply is
graded with `geo3k_reward` (0.9·accuracy + 0.1·format).
"""

from __future__ import annotations

import base64
import io
import json
import math
import random
import re
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

from workbench.api import Env, Result, geo3k_reward, is_equivalent

SIZE = 112
MARGIN = 16
# the built-in bitmap font: the same pixels with any FreeType
FONT = ImageFont.load_default_imagefont()
# True: x and the given angle are supplementary (else equal)
RELATIONS = {
    "corresponding": False,
    "alternate interior": False,
    "same-side interior": True,
}


# ---- drawing -------------------------------------------------------------------------------------


def _fit(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Scale and centre points given in maths coordinates (y up) into the image (y down)."""
    xs = [p[0] for p in points]
    ys = [p[1] for p in points]
    scale = (SIZE - 2 * MARGIN) / max(max(xs) - min(xs), max(ys) - min(ys))
    dx = (SIZE - scale * (max(xs) - min(xs))) / 2 - scale * min(xs)
    dy = (SIZE - scale * (max(ys) - min(ys))) / 2 + scale * max(ys)
    return [(dx + scale * x, dy - scale * y) for x, y in points]


def _label(draw: ImageDraw.ImageDraw, at: tuple[float, float], text: str) -> None:
    """Write text centred at `at`."""
    x, y = at
    left, top, right, bottom = draw.textbbox((0, 0), text, font=FONT)
    draw.text(
        (round(x - (right - left) / 2), round(y - (bottom - top) / 2)),
        text,
        fill="black",
        font=FONT,
    )


def _angle(draw: ImageDraw.ImageDraw, vertex, toward1, toward2, text: str) -> None:
    """Mark the angle at `vertex` between the rays to `toward1` and `toward2` with an arc and a
    label on its bisector."""
    units = [
        ((p[0] - vertex[0]) / math.dist(p, vertex), (p[1] - vertex[1]) / math.dist(p, vertex))
        for p in (toward1, toward2)
    ]
    directions = sorted(math.degrees(math.atan2(u[1], u[0])) % 360 for u in units)
    if directions[1] - directions[0] > 180:
        directions.reverse()
    start, end = directions
    draw.arc([vertex[0] - 7, vertex[1] - 7, vertex[0] + 7, vertex[1] + 7], start, end, fill="black")
    half = math.radians((end - start) % 360 / 2)
    left, top, right, bottom = draw.textbbox((0, 0), text, font=FONT)
    # clear of both rays
    distance = min(30.0, math.hypot(right - left, bottom - top) / 2 / math.sin(half) + 3)
    bisector = (units[0][0] + units[1][0], units[0][1] + units[1][1])
    norm = math.hypot(*bisector)
    _label(
        draw,
        (vertex[0] + distance * bisector[0] / norm, vertex[1] + distance * bisector[1] / norm),
        text,
    )


def _png(draw_fn) -> bytes:
    image = Image.new("RGB", (SIZE, SIZE), "white")
    draw_fn(ImageDraw.Draw(image))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _radical(square: int) -> str:
    """sqrt(square) in simplest radical form: 5, \\sqrt{13}, 5\\sqrt{2}."""
    outside = max(k for k in range(1, math.isqrt(square) + 1) if square % (k * k) == 0)
    inside = square // outside**2
    if inside == 1:
        return str(outside)
    if outside == 1:
        return f"\\sqrt{{{inside}}}"
    return f"{outside}\\sqrt{{{inside}}}"


def _pi(coefficient: int) -> str:
    return "\\pi" if coefficient == 1 else f"{coefficient}\\pi"


# ---- the five kinds: each returns (values, answer, distractor answers, problem text, PNG) --------


def _triangle_angle(rng: random.Random):
    a = 90
    b = 90
    # every angle at least 40°, so the labels have room
    while a + b > 140:
        a = rng.randrange(40, 80, 5)
        b = rng.randrange(40, 80, 5)
    x = 180 - a - b
    tan_a = math.tan(math.radians(a))
    tan_b = math.tan(math.radians(b))
    # angle a at A, b at B
    A, B, C = _fit([(0, 0), (1, 0), (tan_b / (tan_a + tan_b), tan_a * tan_b / (tan_a + tan_b))])

    def draw(d):
        d.polygon([A, B, C], outline="black", width=2)
        for vertex, text, others in ((A, f"{a}°", (B, C)), (B, f"{b}°", (A, C)), (C, "x", (A, B))):
            _angle(d, vertex, *others, text)

    text = f"Two angles of the triangle measure {a}° and {b}°. Find x, the third angle, in degrees."
    return (
        {"a": a, "b": b},
        str(x),
        [str(v) for v in (a + b, 180 - a, 180 - b, x + 10, abs(x - 10), 360 - a - b)],
        text,
        _png(draw),
    )


def _right_triangle(rng: random.Random):
    a = 1
    b = 9
    while max(a, b) > 3 * min(a, b):  # not too thin to read
        a = rng.randint(1, 8)
        b = rng.randint(1, 8)
    A, B, C = _fit([(0, 0), (a, 0), (0, b)])  # right angle at A

    def draw(d):
        d.polygon([A, B, C], outline="black", width=2)
        d.rectangle([A[0], A[1] - 7, A[0] + 7, A[1]], outline="black")
        _label(d, ((A[0] + B[0]) / 2, A[1] + 8), str(a))
        _label(d, (A[0] - 8, (A[1] + C[1]) / 2), str(b))
        middle = (B[0] + C[0]) / 2, (B[1] + C[1]) / 2
        # the label 10 pixels outside the hypotenuse
        outward = math.dist(middle, A) / 10
        _label(
            d,
            (middle[0] + (middle[0] - A[0]) / outward, middle[1] + (middle[1] - A[1]) / outward),
            "x",
        )

    text = f"The legs of the right triangle measure {a} and {b}. Find x, the hypotenuse."
    wrong = [
        _radical(s)
        for s in (
            a * a + b * b + 1,
            (a + 1) ** 2 + b * b,
            a * a + (b + 1) ** 2,
            abs(a * a - b * b) or 2,
        )
    ]
    return {"a": a, "b": b}, _radical(a * a + b * b), wrong + [str(a + b)], text, _png(draw)


def _circle(rng: random.Random):
    r = rng.randint(1, 9)
    asked = rng.choice(["area", "circumference"])

    def draw(d):
        d.ellipse([MARGIN, MARGIN, SIZE - MARGIN, SIZE - MARGIN], outline="black", width=2)
        d.ellipse([SIZE / 2 - 2, SIZE / 2 - 2, SIZE / 2 + 2, SIZE / 2 + 2], fill="black")
        d.line([(SIZE / 2, SIZE / 2), (SIZE - MARGIN, SIZE / 2)], fill="black", width=2)
        _label(d, (SIZE * 3 / 4 - MARGIN / 2, SIZE / 2 - 8), str(r))

    coefficient = r * r if asked == "area" else 2 * r
    text = f"The radius of the circle is {r}. Find the {asked} of the circle, in terms of \\pi."
    return (
        {"r": r, "asked": asked},
        _pi(coefficient),
        [_pi(c) for c in (r, 2 * r, r * r, 4 * r * r, 2 * r * r, coefficient + 1)],
        text,
        _png(draw),
    )


def _parallel_lines(rng: random.Random):
    g = rng.randrange(40, 141, 10)
    relation = rng.choice(sorted(RELATIONS))
    if g == 90:
        g = 100
    x = 180 - g if RELATIONS[relation] else g
    top = 34
    bottom = 78
    # the transversal climbs at g degrees from the right ray
    rise = math.tan(math.radians(g))
    top_x = SIZE / 2 + (bottom - top) / 2 / rise
    bottom_x = SIZE / 2 - (bottom - top) / 2 / rise
    # label spots: given angle g in the lower-left quadrant at the top crossing; x at the bottom
    # crossing
    spot_x = {
        "corresponding": (-1, 1),
        "alternate interior": (1, -1),
        "same-side interior": (-1, -1),
    }[relation]

    def quadrant(d, cx, cy, sx, sy, text):
        """Mark a quadrant at a crossing (sx: +1 right; sy: +1 below the line)."""
        up = math.cos(math.radians(g)), -math.sin(math.radians(g))  # the transversal's upward ray
        ray = up if sy < 0 else (-up[0], -up[1])
        _angle(d, (cx, cy), (cx + sx, cy), (cx + ray[0], cy + ray[1]), text)

    def draw(d):
        for y in (top, bottom):
            d.line([(6, y), (SIZE - 6, y)], fill="black", width=2)
        span = (bottom - top) / 2 + 26
        d.line(
            [(SIZE / 2 - span / rise, SIZE / 2 + span), (SIZE / 2 + span / rise, SIZE / 2 - span)],
            fill="black",
            width=2,
        )
        quadrant(d, top_x, top, -1, 1, f"{g}°")
        quadrant(d, bottom_x, bottom, *spot_x, "x")

    text = (
        f"Two parallel lines are cut by a transversal. An angle measures {g}°, "
        f"and x is its {relation} angle. Find x in degrees."
    )
    return (
        {"g": g, "relation": relation},
        str(x),
        [str(v) for v in (180 - x, x + 10, x - 10, 360 - x, x + 20)],
        text,
        _png(draw),
    )


def _rectangle(rng: random.Random):
    w = rng.randint(2, 9)
    h = rng.randint(2, 9)
    asked = rng.choice(["area", "perimeter"])
    (x0, y0), (x1, y1) = _fit([(0, 0), (w, h)])

    def draw(d):
        d.rectangle([x0, y1, x1, y0], outline="black", width=2)
        _label(d, ((x0 + x1) / 2, y0 + 8), str(w))
        _label(d, (x1 + 8, (y0 + y1) / 2), str(h))

    answer = w * h if asked == "area" else 2 * (w + h)
    text = f"The rectangle has sides {w} and {h}. Find its {asked}."
    return (
        {"w": w, "h": h, "asked": asked},
        str(answer),
        [str(v) for v in (w + h, 2 * (w + h), w * h, 2 * w * h, answer + 2)],
        text,
        _png(draw),
    )


KINDS = {
    "triangle_angle": _triangle_angle,
    "right_triangle": _right_triangle,
    "circle": _circle,
    "parallel_lines": _parallel_lines,
    "rectangle": _rectangle,
}


def make_dataset(size: int, seed: int) -> list[dict]:
    """`size` synthetic samples, kinds in turn, values from `seed` (same seed, same bytes)."""
    rng = random.Random(seed)
    samples = []
    for index in range(size):
        kind = list(KINDS)[index % len(KINDS)]
        values, answer, wrong, text, png = KINDS[kind](rng)
        choices = [answer]
        for candidate in wrong + [str(n) for n in range(1, 400)]:
            if len(choices) < 4 and not any(is_equivalent(candidate, c) for c in choices):
                choices.append(candidate)
        rng.shuffle(choices)
        samples.append(
            {
                "id": f"synthetic-{seed}-{index}",
                "problem": f"<image>{text}",
                "answer": answer,
                "images": [png],
                "choices": choices,
                "kind": kind,
                "values": values,
            }
        )
    return samples


# ---- the real data set ---------------------------------------------------------------------------


def _image_bytes(item, folder: Path) -> bytes:
    """An image given as bytes, a {"bytes", "path"} dict, a path relative to the data file, or
    base64 text."""
    if isinstance(item, dict):
        item = item.get("bytes") or item.get("path")
    if isinstance(item, (bytes, bytearray)):
        return bytes(item)
    if isinstance(item, str) and (
        item.startswith("data:") or re.fullmatch(r"[A-Za-z0-9+/=\s]+", item)
    ):
        return base64.b64decode(item.split(",", 1)[-1])
    if isinstance(item, str):
        return (folder / item).read_bytes()
    raise ValueError(f"an image of type {type(item).__name__}")


def _samples(rows: list[dict], folder: Path, where: Path) -> list[dict]:
    """Rows of the real shape as samples: images to bytes (each opened once), a letter answer to
    its choice's value."""
    if not all(isinstance(row, dict) for row in rows):
        raise ValueError(
            f"Data set {where} holds rows that are not objects: "
            f"give one object with images, problem and answer per row."
        )
    answered = []
    for row in rows:
        row = dict(row)
        if row.get("answer") is None:
            row["answer"] = row.get("ground_truth")
        answered.append(row)
    rows = answered
    absent = []
    for column in ("images", "problem", "answer"):
        if all(row.get(column) is None for row in rows):
            absent.append(column)
    if absent:
        raise ValueError(
            f"Data set {where} has no {', '.join(absent)} column: "
            f"a geo3k data set needs images, problem and answer "
            f"(or ground_truth); molt-wb prepare geo3k SRC OUT converts the original release."
        )
    samples = []
    for index, row in enumerate(rows):
        missing = [c for c in ("images", "problem", "answer") if row.get(c) is None]
        if missing:
            raise ValueError(
                f"Data set {where} row {index} (id {row.get('id', index)}) "
                f"has no {', '.join(missing)}: fill it or drop that row."
            )
        images = []
        for number, item in enumerate(row["images"]):
            try:
                images.append(_image_bytes(item, folder))
                Image.open(io.BytesIO(images[-1])).verify()
            except Exception as error:
                raise ValueError(
                    f"Data set {where} row {index} (id {row.get('id', index)}): "
                    f"image {number} cannot be opened ({error}); fix or drop that row."
                ) from None
        choices = None
        if isinstance(row.get("choices"), list):
            choices = [str(c) for c in row["choices"]]
        answer = str(row["answer"]).strip()
        # a choice letter becomes the choice's value
        if choices and re.fullmatch(r"[A-H]", answer) and "ABCDEFGH".index(answer) < len(choices):
            answer = choices["ABCDEFGH".index(answer)]
        problem = str(row["problem"])
        if "<image>" not in problem:
            problem = "<image>" * len(images) + problem
        samples.append(
            {
                "id": str(row.get("id", index)),
                "answer": answer,
                "images": images,
                "choices": choices,
                "problem": problem,
                "kind": row.get("kind") or "geo3k",
            }
        )
    return samples


def load_dataset(path: str | Path) -> list[dict]:
    """Read a Geometry3K Parquet or JSONL file (the hiyouga/geometry3k shape) into samples;
    ValueError names any problem."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(
            f"Data set {path} does not exist: give data.path as a .parquet or .jsonl file "
            f"(molt-wb prepare geo3k SRC OUT converts the public Geometry3K release)."
        )
    if path.suffix == ".parquet":
        import pyarrow.parquet

        rows = pyarrow.parquet.read_table(path).to_pylist()
    elif path.suffix in (".jsonl", ".json"):
        text = path.read_text(encoding="utf-8")
        try:
            if text.lstrip().startswith("["):
                rows = json.loads(text)
            else:
                rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as error:
            raise ValueError(
                f"Data set {path} is not JSON lines ({error}): write one JSON object per line."
            ) from None
    else:
        raise ValueError(f"Data set {path} has an unknown format: give a .parquet or .jsonl file.")
    if not rows:
        raise ValueError(f"Data set {path} has no rows: give a file with at least one sample.")
    return _samples(rows, path.parent, path)


def save_dataset(samples: list[dict], out: str | Path) -> None:
    """Write samples as Parquet (images as {"bytes", "path"} structs) or JSONL (images as
    base64)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    keys = ("id", "problem", "answer", "choices", "kind")
    if out.suffix == ".parquet":
        import pyarrow
        import pyarrow.parquet

        rows = []
        for s in samples:
            images = [{"bytes": b, "path": None} for b in s["images"]]
            rows.append({**{k: s.get(k) for k in keys}, "images": images})
        pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), out)
    elif out.suffix == ".jsonl":
        with out.open("w", encoding="utf-8") as handle:
            for s in samples:
                row = {
                    **{k: s.get(k) for k in keys},
                    "images": [base64.b64encode(b).decode() for b in s["images"]],
                }
                handle.write(json.dumps(row) + "\n")
    else:
        raise ValueError(f"Output {out} has an unknown format: name it .parquet or .jsonl.")


def prepare(src: str | Path, out: str | Path) -> int:
    """Convert one split of the original release (<id>/data.json + img_diagram.png) or a hiyouga
    Parquet/JSONL; return the row count."""
    src = Path(src)
    if src.is_file():
        samples = load_dataset(src)
    elif src.is_dir():
        splits = [
            name for name in ("train", "val", "test") if any((src / name).glob("*/data.json"))
        ]
        if len(splits) > 1:
            raise ValueError(
                f"{src} holds several splits ({', '.join(splits)}): "
                f"give one split folder, e.g. {src / splits[0]}."
            )
        found = sorted(src.rglob("data.json"), key=lambda p: (len(p.parent.name), p.parent.name))
        if not found:
            raise ValueError(
                f"{src} holds no <id>/data.json: "
                f"give a split folder of the Geometry3K release or a .parquet/.jsonl file."
            )
        rows = []
        for data_path in found:
            data = json.loads(data_path.read_text(encoding="utf-8"))
            missing = [k for k in ("problem_text", "choices", "answer") if k not in data]
            if missing or not (data_path.parent / "img_diagram.png").is_file():
                raise ValueError(
                    f"{data_path} lacks {', '.join(missing) or 'its img_diagram.png'}: "
                    f"give a folder of the original Geometry3K release."
                )
            rows.append(
                {
                    "id": str(data.get("id", data_path.parent.name)),
                    "problem": "<image>" + data["problem_text"],
                    "answer": data["answer"],
                    "choices": data["choices"],
                    "images": [str(data_path.parent / "img_diagram.png")],
                }
            )
        samples = _samples(rows, src, src)
    else:
        raise ValueError(
            f"{src} does not exist: "
            f"give a split folder of the Geometry3K release or a .parquet/.jsonl file."
        )
    save_dataset(samples, out)
    return len(samples)


class Geo3kEnv(Env):
    system_prompt = "Reason step by step, then give only the final answer as \\boxed{...}."

    def reset(self, sample: dict) -> str:
        self.sample = sample
        return sample["problem"]

    def step(self, action: str) -> Result:
        reward, info = geo3k_reward(action, self.sample["answer"], self.sample.get("choices"))
        return Result(reward=reward, info=info)


AgentRunner = Geo3kEnv
