"""Answer extraction and numeric equivalence: notations that mean the same number match, nothing
else does."""

import time

import pytest

from workbench.tools.grading import extract_answer, format_ok, geo3k_reward, grade, is_equivalent

EQUIVALENT = [
    ("70", "70"),
    ("70.0", "70"),
    ("+70", "70"),
    ("-3", "-3"),
    ("−3", "-3"),
    ("0.5", "1/2"),
    (".5", "0.5"),
    ("3/4", "0.75"),
    ("\\frac{3}{4}", "3/4"),
    ("\\dfrac{3}{4}", "0.75"),
    ("\\tfrac34", "0.75"),
    ("\\frac12", "0.5"),
    ("\\frac{\\sqrt{3}}{2}", "0.8660"),
    ("\\frac{1}{\\frac{1}{2}}", "2"),
    ("70°", "70"),
    ("70^\\circ", "70"),
    ("70^{\\circ}", "70"),
    ("70 degrees", "70"),
    ("70\\degree", "70"),
    ("5 cm", "5"),
    ("5\\text{ cm}", "5"),
    ("25 \\text{ cm}^2", "25"),
    ("12 square units", "12"),
    ("8 ft", "8"),
    ("\\sqrt{2}", "1.4142"),
    ("\\sqrt2", "\\sqrt{2}"),
    ("√3", "\\sqrt{3}"),
    ("2\\sqrt{3}", "\\sqrt{12}"),
    ("2√3", "2\\sqrt{3}"),
    ("5\\sqrt{2}", "7.07"),
    ("\\sqrt[3]{27}", "3"),
    ("2 \\cdot 3", "6"),
    ("2\\times 4", "8"),
    ("\\pi", "3.1416"),
    ("π", "\\pi"),
    ("4\\pi", "4π"),
    ("12.57", "4\\pi"),
    ("12.6", "4\\pi"),
    ("4\\pi", "12.566"),
    ("25\\pi", "78.54"),
    ("\\frac{9\\pi}{2}", "4.5\\pi"),
    ("2\\pi r", "2\\pi r"),
    ("x = 5", "5"),
    ("x=5", "5"),
    ("m \\angle ABC = 70", "70"),
    ("4\\pi \\approx 12.57", "4\\pi"),
    ("$12$", "12"),
    ("1,234", "1234"),
    ("12,345,678", "12345678"),
    ("2(3)", "6"),
    ("(2)(3)", "6"),
    ("√12", "2\\sqrt{3}"),
    ("2^3", "8"),
    ("3^{2}", "9"),
    ("5.", "5"),
    ("\\left(\\frac{1}{2}\\right)", "0.5"),
    ("\\overline{AB}", "\\overline{ AB }"),
    ("0.3333", "\\frac{1}{3}"),
]

NOT_EQUIVALENT = [
    ("7", "70"),
    ("70", "7"),
    ("1/2", "2"),
    ("2", "1/2"),
    ("\\sqrt{2}", "2"),
    ("√2", "2"),
    ("2\\sqrt{3}", "6"),
    ("4", "4\\pi"),
    ("13", "4\\pi"),
    ("12", "4\\pi"),
    ("13.", "4\\pi"),
    ("0.3", "0.33"),
    ("-5", "5"),
    ("70", "110"),
    ("", "5"),
    ("   ", "5"),
    (None, "5"),
    ("five", "5"),
    ("3,4", "34"),
    ("1,23", "123"),
    ("9**9**9", "1"),
    ("\\frac{1}{0}", "1"),
    ("\\sqrt{-4}", "2"),
    ("\\frac{3}{4", "0.75"),
    ("x", "5"),
    ("5", "5x"),
]


@pytest.mark.parametrize("pred, truth", EQUIVALENT)
def test_equivalent_notations_match(pred, truth):
    assert is_equivalent(pred, truth)
    # symmetric, except where the truth's own rounding decides
    assert is_equivalent(truth, pred) or "." in truth


@pytest.mark.parametrize("pred, truth", NOT_EQUIVALENT)
def test_different_values_and_non_answers_do_not_match(pred, truth):
    assert not is_equivalent(pred, truth)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("So the answer is \\boxed{70}.", "70"),
        ("\\boxed{\\frac{3}{4}}", "\\frac{3}{4}"),
        ("first \\boxed{1} then \\boxed{2}", "2"),
        ("<answer>12</answer>", "12"),
        ("<answer> x = 5 </answer>", "x = 5"),
        ("\\boxed{3} and finally <answer>4</answer>", "4"),
        ("<answer>4</answer> but actually \\boxed{5}", "5"),
        ("<answer>\\boxed{2\\sqrt{3}}</answer>", "2\\sqrt{3}"),
        ("\\boxed{\\frac{\\sqrt{3}}{\\sqrt{4}}}", "\\frac{\\sqrt{3}}{\\sqrt{4}}"),
        ("\\boxed {9}", "9"),
        ("<answer>\nmulti\nline\n</answer>", "multi\nline"),
        ("the answer is 70", None),
        ("\\boxed{70", None),
        ("\\boxed{}", None),
        ("<answer></answer>", None),
        ("", None),
    ],
)
def test_extract_answer_takes_the_last_answer_tag_or_box(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    "text, ok",
    [
        ("The angles sum to 180, so x = 180 - 50 - 60 = 70. \\boxed{70}", True),
        ("Reasoning here.\n<answer>70</answer>", True),
        ("<think>50 + 60 = 110; 180 - 110 = 70</think> <answer>70</answer>", True),
        ("Area is pi r^2. $\\boxed{25\\pi}$.", True),
        ("\\boxed{70}", False),  # no reasoning
        ("<answer>70</answer>", False),
        ("x is \\boxed{70} and then more words", False),  # something after the answer
        ("first \\boxed{60}, no: \\boxed{70}", False),  # two answers
        ("<think>unfinished <answer>70</answer>", False),
        ("reasoning \\boxed{}", False),
        ("no answer at all", False),
    ],
)
def test_format_is_reasoning_then_exactly_one_final_answer(text, ok):
    assert format_ok(text) is ok


CHOICES = ["50", "70", "4\\pi", "2\\sqrt{3}"]


@pytest.mark.parametrize(
    "text, answer, choices, correct",
    [
        ("... \\boxed{B}", "B", CHOICES, True),  # letter reply, letter answer
        ("... \\boxed{(B)}", "70", CHOICES, True),  # letter reply, value answer
        ("... \\boxed{70}", "B", CHOICES, True),  # value reply, letter answer
        ("... \\boxed{\\text{B}}", "B", CHOICES, True),
        ("... \\boxed{12.57}", "C", CHOICES, True),
        ("... \\boxed{√12}", "D", CHOICES, True),
        ("... \\boxed{A}", "B", CHOICES, False),
        ("... \\boxed{50}", "B", CHOICES, False),
        ("... \\boxed{B}", "70", None, False),  # without choices a letter is just text
        ("... \\boxed{E}", "E", CHOICES, True),  # no fifth choice: compared as text
        ("... nothing boxed", "70", CHOICES, False),
    ],
)
def test_grade_maps_choice_letters_to_their_values(text, answer, choices, correct):
    assert grade(text, answer, choices) is correct


def test_geo3k_reward_is_point_nine_accuracy_plus_point_one_format():
    assert geo3k_reward("180 - 50 - 60 = 70. \\boxed{70^\\circ}", "70") == (
        1.0,
        {"pred": "70^\\circ", "accuracy": 1.0, "format": 1.0},
    )
    assert geo3k_reward("\\boxed{70}", "70")[0] == pytest.approx(0.9)  # right, but no reasoning
    # well formed, wrong
    assert geo3k_reward("I think it is \\boxed{60}", "70")[0] == pytest.approx(0.1)
    # no tag: nothing to grade
    assert geo3k_reward("70", "70") == (0.0, {"pred": None, "accuracy": 0.0, "format": 0.0})
    assert geo3k_reward("so \\boxed{C}", "12.57", CHOICES)[0] == pytest.approx(1.0)


def test_a_hostile_answer_is_graded_quickly_and_safely():
    deep = "(" * 500 + "1" + ")" * 500
    assert not is_equivalent(deep, "2") and is_equivalent("(" * 50 + "1" + ")" * 50, "1")
    assert not is_equivalent("__import__('os').system('echo hi')", "0")
    assert extract_answer("\\boxed{" * 5000 + "x") is None  # never closed
    assert extract_answer("\\boxed{" * 2 + "5" + "}" * 2) == "5"


def test_power_towers_and_deep_brackets_are_graded_in_milliseconds():
    # latex2sympy2_extended 1.11 (math-verify's parser): 5 s on the brackets, hangs on the tower
    start = time.perf_counter()
    assert not is_equivalent("9^{9^{9^{9}}}", "1")
    assert not is_equivalent("[" * 20 + "1" + "]" * 20, "1")
    assert is_equivalent("{" * 20 + "1" + "}" * 20, "1")
    assert time.perf_counter() - start < 1.0
