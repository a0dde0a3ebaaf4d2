"""The template preflight (`molt-wb check-template`, and `molt-wb train` at start-up): each model
family's own chat template and response parser through the cases that break token identity, with
the status of every case under both `agent.history_rewrite` modes written out by hand from what
each template does (tests/fixtures/templates.py), templates broken on purpose, and SmolLM2's real
template from the model cache."""

import copy
import shutil
import subprocess
import sys

import pytest
from fixtures.templates import FAMILIES, QWEN3_CODER_RESPONSE, tiny_in_family
from typer.testing import CliRunner, Result

from workbench.cli import app
from workbench.config import compose_config
from workbench.models.pretrained import cached_path
from workbench.run.check_template import calls_tools
from workbench.run.preflight import CASES, TOOL_CASES, check, startup_warnings

# the runs of this module join one Ray (conftest.one_ray)
pytestmark = pytest.mark.usefixtures("one_ray")

PASS = "pass"
FAIL = "FAIL"
NA = "n/a"
ALL_PASS = dict.fromkeys(CASES, (PASS, PASS))
# Qwen3 drops the empty think block of the last assistant turn once another message follows: every
# case past one turn seals under seal and extends under bridge
QWEN3 = dict.fromkeys(CASES, (FAIL, PASS)) | {"default_system": (PASS, PASS)}
# Llama 3.1: no reasoning field, one call per turn (the template raises), a call is the whole reply
LLAMA3 = ALL_PASS | {
    "reasoning": (NA, NA),
    "parallel_calls": (NA, NA),
    "call_with_content": (NA, NA),
}
QWEN3_CODER = ALL_PASS | {"reasoning": (NA, NA)}
EXPECTED = {"qwen3": QWEN3, "llama3": LLAMA3, "qwen3_coder": QWEN3_CODER}


def statuses(report) -> dict[str, tuple[str, str]]:
    return {case: (seal, bridge) for case, seal, bridge, _ in report.rows()}


@pytest.fixture(scope="module")
def families(tokenizer):
    return {name: family.tokenizer(tokenizer) for name, family in FAMILIES.items()}


def test_the_tiny_template_passes_every_case_and_keeps_seal(tokenizer):
    report = check(tokenizer)
    assert statuses(report) == ALL_PASS
    assert report.recommended == "seal"
    assert dict((c, d) for c, _, _, d in report.rows())["default_system"] == (
        "no system prompt inserted"
    )


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_familys_cases_read_as_its_template_behaves(families, family):
    report = check(families[family])
    assert statuses(report) == EXPECTED[family]
    assert report.recommended == ("bridge" if family == "qwen3" else "seal")


def test_qwen3s_rewrite_is_named_and_bridge_is_recommended(families):
    report = check(families["qwen3"])
    multi_turn = report.outcome("multi_turn", "seal")
    assert multi_turn.detail == (
        "turn 2 sealed the segment (template_rewrite): the history rewrote"
    )
    assert "agent.history_rewrite=bridge" in report.advice()
    assert "reasoning" in report.advice()


def test_llama3s_limits_are_said_not_failed(families):
    details = {case: detail for case, _, _, detail in check(families["llama3"]).rows()}
    assert details["parallel_calls"] == (
        "the chat template refuses it (This model only supports single tool-calls at once!)"
    )
    assert details["call_with_content"] == "the chat template writes no content beside a tool call"
    # its header holds a knowledge date and a fixed 'today': text no message holds
    assert details["default_system"].startswith("inserts 'Cutting Knowledge Date: December 2023")


def test_a_response_template_that_cannot_read_the_chat_templates_calls_fails_them(tokenizer):
    # the tiny chat template writes hermes JSON calls; the Qwen3-Coder parser looks for XML
    mismatched = copy.deepcopy(tokenizer)
    mismatched.response_template = QWEN3_CODER_RESPONSE
    report = statuses(check(mismatched))
    for case in ("tool_call", "parallel_calls", "call_with_content"):
        assert report[case] == (FAIL, FAIL)
    assert report["multi_turn"] == (PASS, PASS)


def test_a_template_that_hides_the_tools_fails_the_tool_cases(tokenizer):
    hidden = copy.deepcopy(tokenizer)
    hidden.chat_template = tokenizer.chat_template.replace("{%- if tools %}", "{%- if false %}")
    details = {case: (seal, detail) for case, seal, _, detail in check(hidden).rows()}
    assert details["tool_call"] == (FAIL, "the chat template does not show the tools to the policy")


def test_a_template_that_reads_the_clock_fails_the_system_prompt_case(tokenizer):
    dated = copy.deepcopy(tokenizer)
    dated.chat_template = (
        "{{- 'Today: ' + strftime_now('%d %b %Y') + '\\n' }}" + tokenizer.chat_template
    )
    report = check(dated)
    outcome = report.outcome("default_system", "seal")
    assert outcome.status == FAIL and "strftime_now" in outcome.detail
    assert report.outcome("multi_turn", "seal").status == PASS


def test_startup_warnings_say_one_sentence_per_failing_case_and_the_mode_that_passes(tmp_path):
    folder = tiny_in_family("qwen3", str(tmp_path / "tiny-qwen3"))
    sentences = startup_warnings(folder, "seal")
    assert len(sentences) == len([case for case, (seal, _) in QWEN3.items() if seal == FAIL])
    assert sentences[0] == (
        "template check, multi_turn: turn 2 sealed the segment (template_rewrite): the history "
        f"rewrote; agent.history_rewrite=bridge passes it (molt-wb check-template {folder})."
    )
    assert startup_warnings(folder, "bridge") == []
    assert startup_warnings("tiny", "seal") == []
    # a policy that never calls a tool is not warned about the tool cases
    without = startup_warnings(folder, "seal", tools=False)
    assert [s.split(",")[1].split(":")[0].strip() for s in without] == [
        case for case, (seal, _) in QWEN3.items() if seal == FAIL and case not in TOOL_CASES
    ]


def test_only_a_run_whose_policy_may_call_tools_is_checked_for_them():
    assert not calls_tools(compose_config(["+recipe=arith"]))
    assert not calls_tools(compose_config(["+recipe=smol_gcd"]))
    # geo3k's Env lists its Python tool; a ChatAgent's client may send tools with any request
    assert calls_tools(compose_config(["+recipe=geo3k"]))
    assert calls_tools(compose_config(["+recipe=geo3k", "agent.plugin=chat_geo3k"]))


def molt_wb(*args: str) -> Result:
    """The command run in this process (its imports are the test session's)."""
    return CliRunner().invoke(app, list(args))


def test_the_command_prints_the_table_and_the_mode_and_exits_0_when_that_mode_passes(tmp_path):
    folder = tiny_in_family("qwen3", str(tmp_path / "tiny-qwen3"))
    result = molt_wb("check-template", folder)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert any(
        line.split("│")[1:4] == [" multi_turn        ", " FAIL ", " pass   "] for line in lines
    )
    assert "recommended: agent.history_rewrite=bridge" in result.stdout


def test_the_command_exits_1_when_a_case_fails_under_the_recommended_mode(tmp_path, tiny_path):
    folder = tmp_path / "hidden-tools"
    shutil.copytree(tiny_path, folder)
    template = folder / "chat_template.jinja"
    template.write_text(template.read_text().replace("{%- if tools %}", "{%- if false %}"))
    result = molt_wb("check-template", str(folder))
    assert result.exit_code == 1
    assert "does not show the tools to the policy" in result.stdout
    assert "recommended: agent.history_rewrite=seal" in result.stdout


def test_an_unknown_model_is_one_sentence():
    result = molt_wb("check-template", "no-such-model")
    assert result.exit_code == 2
    assert result.stderr.strip() == (
        "error: no-such-model is neither a checkpoint folder, a .gguf file nor a built-in model "
        "(tiny, small, tiny-moe, tiny-mixtral, tiny-vl, smollm2-135m): give one of those."
    )


def test_smollm2s_real_template_hides_the_tools_and_inserts_its_system_prompt():
    folder = cached_path("smollm2-135m")
    if folder is None:
        pytest.skip(
            "SmolLM2-135M is not in the model cache: `molt-wb check-template smollm2-135m` (or "
            "tests/test_gguf.py) fetches and converts it once"
        )
    from transformers import AutoTokenizer

    report = check(AutoTokenizer.from_pretrained(folder))
    hidden = (FAIL, FAIL)
    assert statuses(report) == ALL_PASS | dict.fromkeys(
        ("tool_call", "parallel_calls", "call_with_content"), hidden
    )
    assert report.outcome("default_system", "seal").detail == (
        "inserts 'You are a helpful AI assistant named SmolLM, trained by Hugging Face' before "
        "the first message (in every prompt, mask 0)"
    )
    assert report.recommended == "seal"


@pytest.mark.slow
def test_train_warns_once_per_failing_case_before_it_starts(tmp_path):
    folder = tiny_in_family("qwen3", str(tmp_path / "tiny-qwen3"))
    command = [sys.executable, "-m", "workbench.cli", "train", "+recipe=arith"]
    command += [f"model.path={folder}", "model.warm_start_steps=0", "trainer.steps=1"]
    command += ["trainer.prompts_per_step=2", "trainer.group_size=2", "tracking=none"]
    command += ["run.progress=false", f"run.root={tmp_path / 'runs'}"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    warned = [line for line in result.stderr.splitlines() if "template check" in line]
    # arith's Env calls no tool: the tool cases are not its concern
    failing = [c for c, (seal, _) in QWEN3.items() if seal == FAIL and c not in TOOL_CASES]
    assert [line.split(",")[1].split(":")[0].strip() for line in warned] == failing
    assert warned[0].startswith("warning: template check, multi_turn: turn 2 sealed the segment")
