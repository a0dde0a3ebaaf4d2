"""`molt-wb inspect`: a Textual app over one run folder (or all of them), read-only and live.

Screens: runs (filterable by sweep, `runs_screen.py`) → run (overview · segments · gate · requests
· failures tabs, `run_screen.py`) → token view of one segment (`token_screen.py`), where every
sampled token is coloured by a chosen channel (`channels.py`). This module holds the app, its style
and its help.
"""

from textual.app import App
from textual.binding import Binding
from textual.screen import ModalScreen
from textual.widgets import Static

from workbench.tui.data import RunData
from workbench.tui.run_screen import RunScreen
from workbench.tui.runs_screen import RunsScreen

HELP = """[b]molt-wb inspect[/b] — keys
runs:     enter open · s sweep filter · q quit
run:      1 overview · 2 segments · 3 gate · 4 requests · 5 failures · esc back
segments: enter token view · / filter · d only dropped · m only mismatches
          o or a click on a header: sort · ] [ next/previous page
          filter words: dropped  mismatch  reward>=0.5  reward<1  any text
token:    ← → token · home end · . next sampled · c channel · n p segment
          prompt/env tokens dim; ▸ ◂ a sampled turn; ▣ image (drawn under
          the values; in half-block cells where MOLT_WB_IMAGES is cells)
everywhere: ? help · q quit"""


class Help(ModalScreen):
    BINDINGS = [("escape,question_mark,q", "app.pop_screen", "Close")]

    def compose(self):
        yield Static(HELP, id="help")


class InspectApp(App):
    TITLE = "molt-wb inspect"
    CSS = """
    Input { border: none; height: 1; }
    .status { height: 1; color: $text-muted; }
    .plot { height: 12; }
    #legend { height: auto; max-height: 3; }
    #failures-traceback { height: auto; max-height: 12; border-top: solid $accent; }
    #side-column { width: 30; border-left: solid $accent; }
    #side { height: auto; padding: 0 1; }
    #images { padding: 0 1; }
    #images > * { width: auto; height: auto; }
    #help { width: 80; height: auto; border: thick $accent; background: $surface; padding: 1 2; }
    Help { align: center middle; }
    """
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("question_mark", "help", "Help", key_display="?"),
    ]

    def __init__(self, root="runs", run_id=None, sweep="", poll=2.0):
        super().__init__()
        self.root = root
        self.run_id = run_id
        self.sweep = sweep
        self.poll = poll

    def on_mount(self):
        self.push_screen(RunsScreen())
        if self.run_id:
            self.push_screen(RunScreen(RunData(self.run_id, self.root)))

    def action_help(self):
        self.push_screen(Help())
