"""Final-answer extraction and numeric-equivalence grading for math answers (Geometry3K style).

Invariant: two answers are equivalent when both evaluate to the same number (within 1e-4 relative,
or within the rounding of the truth's decimal places, or else of the prediction's), whatever their
notation (`\\frac{3}{4}`, `0.75`, `3/4`; `4\\pi`, `4π`, `12.57`; `2\\sqrt{3}`, `2√3`), units, degree
signs, a leading `x =` or thousands commas; answers that are not numbers are compared as
normalised text. Pure Python and fast: expressions are tokenised to floats, `pi`, `sqrt`,
operators and brackets before evaluation.
"""

import math
import re

ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
UNITS = re.compile(
    r"(?<![a-z])(?:square|sq|cubic|units?|cm|mm|km|m|in|inch|inches|ft|feet|foot|yd|yards?|miles?|"
    r"(?:centi|milli|kilo)?meters?|degrees?|deg|radians?)(?:\s*\^?\s*\{?[23]\}?|²|³)?(?![a-z])"
)
TOKEN = re.compile(r"\s*(\d+\.\d*|\.\d+|\d+|pi|sqrt|\*\*|[-+*/()])")
LETTERS = "ABCDEFGH"


# ---- extraction ----------------------------------------------------------------------------------


def _closing(text):
    """{index of each `{`: index of the `}` that closes it} (an unclosed one absent), in one pass
    over the braces, so a long reply costs linear time."""
    closing = {}
    open_braces = []
    for brace in re.finditer(r"[{}]", text):
        if brace.group() == "{":
            open_braces.append(brace.start())
        elif open_braces:
            closing[open_braces.pop()] = brace.start()
    return closing


def _answer_spans(text):
    """Every final-answer span (start, end, content): `<answer>` tags and `\\boxed{}` outside
    them."""
    spans = [(m.start(), m.end(), m.group(1)) for m in ANSWER_TAG.finditer(text)]
    closing = _closing(text)
    for match in re.finditer(r"\\boxed\s*(?=\{)", text):
        end = closing.get(match.end())
        if end is not None and not any(start <= match.start() < stop for start, stop, _ in spans):
            spans.append((match.start(), end + 1, text[match.end() + 1 : end]))
    return sorted(spans)


def extract_answer(text: str) -> str | None:
    """The content of the last `<answer>…</answer>` or `\\boxed{…}` (nested braces allowed), or
    None."""
    spans = _answer_spans(text or "")
    if not spans:
        return None
    content = spans[-1][2]
    inner = _answer_spans(content)  # <answer>\boxed{5}</answer>
    if inner:
        content = inner[-1][2]
    return content.strip() or None


def format_ok(text: str) -> bool:
    """Reasoning first, then exactly one final answer tag, and nothing but punctuation after it."""
    spans = _answer_spans(text or "")
    if len(spans) != 1 or not spans[0][2].strip():
        return False
    before = text[: spans[0][0]]
    after = text[spans[0][1] :]
    if "<think>" in before and "</think>" not in before:
        return False
    reasoning = re.sub(r"</?think>", "", before).strip(" \n\t$\\[(")
    return len(reasoning) > 0 and re.fullmatch(r"[\s$.\\\])]*", after) is not None


# ---- evaluation ----------------------------------------------------------------------------------


def _latex(text):
    """Rewrite \\frac, \\sqrt and brace groups as bracketed Python-like text, recursively."""
    out = []
    index = 0
    closing = _closing(text)
    while index < len(text):
        command = re.match(r"\\[dt]?frac|\\sqrt", text[index:])
        if command:
            index += command.end()
            fraction = "frac" in command.group()
            # the degree of a root: \sqrt[3]{x}
            root = not fraction and re.match(r"\s*\[([^\]]*)\]", text[index:])
            if root:
                index += root.end()
            parts = []
            for _ in range(2 if fraction else 1):
                while index < len(text) and text[index] == " ":
                    index += 1
                end = closing.get(index)
                if end is not None:
                    parts.append(_latex(text[index + 1 : end]))
                    index = end + 1
                else:
                    # \frac12, \sqrt 3: a single digit for \frac, a digit run for \sqrt
                    token = re.match(r"." if fraction else r"\d+", text[index:], re.DOTALL)
                    parts.append(token.group() if token else "")
                    index += len(parts[-1])
            if fraction:
                out.append(f"(({parts[0]})/({parts[1]}))")
            elif root:
                out.append(f"(({parts[0]})**(1/({_latex(root.group(1))})))")
            else:
                out.append(f"sqrt({parts[0]})")
        elif text[index] == "{":
            end = closing.get(index)
            if end is None:
                return text
            out.append(f"({_latex(text[index + 1 : end])})")
            index = end + 1
        else:
            out.append(text[index])
            index += 1
    return "".join(out)


def _normalise(answer):
    """Lower-case text with markup, units, degree signs, a leading `x =` and thousands commas
    removed."""
    text = str(answer).strip().strip("$").strip()
    text = re.split(r"=|\\approx|≈", text)[-1]
    text = re.sub(r"\\(?:text|mathrm|textrm|mbox|operatorname)\s*\{([^{}]*)\}", r" \1 ", text)
    text = re.sub(r"\^\s*\{?\s*\\circ\s*\}?|\\circ|\\degree|°|\\%|%", " ", text)
    text = re.sub(r"\\(?:left|right|displaystyle|[,;:! ])|~", " ", text)
    text = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", text).lower()
    text = text.replace("√", "\\sqrt").replace("π", "\\pi").replace("−", "-")
    return UNITS.sub(" ", text).strip().rstrip(".").strip()


def _number(answer):
    """(value, decimal places written, or None unless a plain decimal) of an answer, or None if
    not a number."""
    text = _normalise(answer)
    if not text or len(text) > 200:
        return None
    plain = re.fullmatch(r"[-+]?\d*\.(\d+)", text)
    text = (
        re.sub(r"\\cdot|\\times|×|·", "*", _latex(text))
        .replace("\\pi", "pi")
        .replace("^", "**")
        .replace("÷", "/")
    )
    tokens = []
    index = 0
    while index < len(text.rstrip()):
        match = TOKEN.match(text, index)
        if match is None:
            return None
        tokens.append(match.group(1))
        index = match.end()
    expression = []
    # each token beside the one before it (the first beside None)
    for previous, token in zip([None, *tokens], tokens, strict=False):
        number = token[0].isdigit() or token[0] == "."
        if (
            previous
            and (previous[0].isdigit() or previous[0] in ".)" or previous == "pi")
            and (number or token in ("pi", "sqrt", "("))
        ):
            # 2\sqrt{3}, 4\pi, 2(3)
            expression.append("*")
        expression.append(repr(float(token)) if number else token)
    places = len(plain.group(1)) if plain else None
    # safe: only float literals, pi, sqrt, + - * / ** and brackets reach eval; float ** overflows,
    # never hangs
    try:
        value = eval("".join(expression), {"__builtins__": {}, "pi": math.pi, "sqrt": math.sqrt})
        if not math.isfinite(value):
            return None
        return float(value), places
    except (ArithmeticError, ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        return None


def is_equivalent(pred: object, truth: object) -> bool:
    """Whether a predicted answer means the same as the ground truth (see the module docstring)."""
    if pred is None or truth is None or not str(pred).strip():
        return False
    numbers = _number(pred), _number(truth)
    # a number never equals a text; texts compare normalised
    if None in numbers:
        return numbers == (None, None) and (
            re.sub(r"\s+", "", _normalise(pred)) == re.sub(r"\s+", "", _normalise(truth))
        )
    (value, places), (true_value, true_places) = numbers
    # a decimal matches what rounds to it
    rounded_to = true_places if true_places is not None else places
    tolerance = max(1e-4 * abs(true_value), 1e-9)
    if rounded_to is not None:
        tolerance = max(tolerance, 0.5 * 10.0**-rounded_to + 1e-12)
    return abs(value - true_value) <= tolerance


def _choice(answer, choices):
    """A choice letter (`B`, `(B)`, `B.`, `\\text{B}`) mapped to its choice's value; anything else
    unchanged."""
    if not choices:
        return answer
    letter = re.fullmatch(r"\s*(?:\\text(?:bf)?\{)?\(?([A-Ha-h])[).:]?\}?\s*", str(answer))
    if letter and (index := LETTERS.index(letter.group(1).upper())) < len(choices):
        return choices[index]
    return answer


def grade(text: str, answer: object, choices: list | None = None) -> bool:
    """Whether the final answer in `text` matches `answer`; a letter answer or reply maps to
    `choices`."""
    return is_equivalent(_choice(extract_answer(text), choices), _choice(answer, choices))


def geo3k_reward(
    text: str, answer: object, choices: list | None = None
) -> tuple[float, dict[str, object]]:
    """The common Geometry3K reward, 0.9·accuracy + 0.1·format, and what it saw."""
    accuracy = float(grade(text, answer, choices))
    formatted = float(format_ok(text))
    return 0.9 * accuracy + 0.1 * formatted, {
        "pred": extract_answer(text),
        "accuracy": accuracy,
        "format": formatted,
    }
