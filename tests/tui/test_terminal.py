"""`molt-wb inspect` in a real terminal: tmux runs the command, keys go in, the pane comes back as
text."""

import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

from workbench.store import open_run

pytestmark = [
    pytest.mark.usefixtures("one_ray"),
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which("tmux") is None, reason="tmux is not installed (.ci/run installs it)"
    ),
]


class Terminal:
    """`molt-wb inspect` in a detached tmux session of 100x30: keys go in, the pane comes back."""

    def __init__(self, socket: Path):
        self.tmux = ["tmux", "-S", str(socket)]

    def start(self, run_id: str, root: str, *env: str) -> None:
        command = " ".join(
            shlex.quote(a)
            for a in [
                "env",
                f"MOLT_WB_CACHE={os.environ['MOLT_WB_CACHE']}",
                *env,
                sys.executable,
                "-m",
                "workbench.cli",
                "inspect",
                run_id,
                "--root",
                root,
            ]
        )
        subprocess.run(
            [*self.tmux, "new-session", "-d", "-s", "tui", "-x", "100", "-y", "30", command],
            check=True,
        )

    def keys(self, *keys: str) -> None:
        subprocess.run([*self.tmux, "send-keys", "-t", "tui", *keys], check=True)

    def pane(
        self,
        *needles: str,
        escapes: bool = False,
        until: Callable[[str], bool] = lambda pane: True,
        timeout: float = 60.0,
    ) -> str:
        """The pane's text (with its colours' escape sequences if `escapes`) once it shows every
        needle and `until` holds of it, or at the timeout (a wide image paints row by row)."""
        flags = ["-p", "-e"] if escapes else ["-p"]
        deadline = time.monotonic() + timeout
        while True:
            pane = subprocess.run(
                [*self.tmux, "capture-pane", *flags, "-t", "tui"], capture_output=True, text=True
            ).stdout
            if all(n in pane for n in needles) and until(pane):
                return pane
            if time.monotonic() > deadline:
                return pane
            time.sleep(0.2)


@pytest.fixture
def terminal(tmp_path):
    terminal = Terminal(tmp_path / "tmux.sock")
    yield terminal
    subprocess.run([*terminal.tmux, "kill-server"], capture_output=True)


def test_the_token_view_in_tmux_shows_a_known_segments_text(made_run, terminal):
    root, run_id = made_run
    prompt, response = (
        open_run(run_id, root)
        .execute(
            "select prompt_text, response_text from segments order by step, rollout_id limit 1"
        )
        .fetchone()
    )
    question = prompt.split("\n")[1].split("<")[0]  # e.g. "What is 1 + 3?"
    terminal.start(run_id[:-2], root)
    assert f"run {run_id}" in terminal.pane(f"run {run_id}", "2 Segments")
    terminal.keys("2")
    assert "rollout_id" in terminal.pane("rollout_id", "rows 1-")
    terminal.keys("Enter")
    pane = terminal.pane("channel", question)
    assert "channel behavior logprob" in pane and f"{question}<|im_end|>↵" in pane
    assert "<|im_start|>user↵" in pane and "token 1/" in pane
    terminal.keys("q")


def test_the_token_view_in_tmux_draws_a_segments_image_in_half_block_cells(
    painted_vl_run, terminal
):
    root, run_id, quadrants = painted_vl_run
    # half-block cells even in a tmux built with sixel (3.4 on Debian), in 24-bit colour
    terminal.start(run_id, root, "MOLT_WB_IMAGES=cells", "COLORTERM=truecolor")
    terminal.pane(f"run {run_id}", "2 Segments")
    terminal.keys("2")
    terminal.pane("rollout_id", "rows 1-")
    terminal.keys("Enter")

    def image_rows(pane: str) -> list[str]:
        return [line for line in pane.splitlines() if line.rstrip().endswith("▀" * 20)]

    pane = terminal.pane("channel", "images: ", until=lambda pane: len(image_rows(pane)) >= 10)
    assert len(image_rows(pane)) >= 10 and "images: " in pane
    coloured = terminal.pane(
        escapes=True, until=lambda pane: all(f"{r};{g};{b}m" in pane for r, g, b in quadrants)
    )
    for red, green, blue in quadrants:
        colour = f"{red};{green};{blue}m"
        # a cell whose upper and lower halves are both the quadrant's colour
        assert f"\x1b[38;2;{colour}\x1b[48;2;{colour}▀" in coloured, colour
    terminal.keys("q")
