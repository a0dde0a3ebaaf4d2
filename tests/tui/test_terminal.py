"""`molt-wb inspect` in a real terminal: tmux runs the command, keys go in, the pane comes back as
text."""

import os
import shlex
import shutil
import subprocess
import sys
import time

import pytest

from workbench.store import open_run

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which("tmux") is None, reason="tmux is not installed (.ci/run installs it)"
    ),
]


def test_the_token_view_in_tmux_shows_a_known_segments_text(made_run, tmp_path):
    root, run_id = made_run
    prompt, response = (
        open_run(run_id, root)
        .execute(
            "select prompt_text, response_text from segments order by step, rollout_id limit 1"
        )
        .fetchone()
    )
    question = prompt.split("\n")[1].split("<")[0]  # e.g. "What is 1 + 3?"
    tmux = ["tmux", "-S", str(tmp_path / "tmux.sock")]
    command = " ".join(
        shlex.quote(a)
        for a in [
            "env",
            f"MOLT_WB_CACHE={os.environ['MOLT_WB_CACHE']}",
            sys.executable,
            "-m",
            "workbench.cli",
            "inspect",
            run_id[:-2],
            "--root",
            root,
        ]
    )
    subprocess.run(
        [*tmux, "new-session", "-d", "-s", "tui", "-x", "100", "-y", "30", command], check=True
    )

    def pane_once(*needles: str, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            pane = subprocess.run(
                [*tmux, "capture-pane", "-p", "-t", "tui"], capture_output=True, text=True
            ).stdout
            if all(n in pane for n in needles) or time.monotonic() > deadline:
                return pane
            time.sleep(0.2)

    try:
        assert f"run {run_id}" in pane_once(f"run {run_id}", "2 Segments")
        subprocess.run([*tmux, "send-keys", "-t", "tui", "2"], check=True)
        assert "rollout_id" in pane_once("rollout_id", "rows 1-")
        subprocess.run([*tmux, "send-keys", "-t", "tui", "Enter"], check=True)
        pane = pane_once("channel", question)
        assert "channel behavior logprob" in pane and f"{question}<|im_end|>↵" in pane
        assert "<|im_start|>user↵" in pane and "token 1/" in pane
        subprocess.run([*tmux, "send-keys", "-t", "tui", "q"], check=True)
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)
