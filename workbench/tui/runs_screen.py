"""The first screen of `molt-wb inspect`: every run under the root, newest first, filterable by
sweep id; enter opens a run."""

from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Header, Input

from workbench.store.query import RUN_COLUMNS, list_runs, run_cells
from workbench.tui.data import RunData
from workbench.tui.run_screen import RunScreen


class RunsScreen(Screen):
    BINDINGS = [
        Binding("s", "focus('#sweep')", "Sweep filter"),
        Binding("escape", "focus('#runs')", "Table", show=False),
    ]

    def compose(self):
        yield Header()
        yield Input(self.app.sweep, placeholder="sweep id filter (s)", id="sweep")
        yield DataTable(id="runs", cursor_type="row", zebra_stripes=True)
        yield Footer()

    def on_mount(self):
        self.query_one(DataTable).add_columns(*RUN_COLUMNS)
        self.load()
        self.set_interval(self.app.poll, self.load)
        self.query_one(DataTable).focus()

    def load(self, *_):
        table = self.query_one(DataTable)
        sweep = self.query_one(Input).value.strip()
        rows = [
            row
            for row in list_runs(self.app.root, mark_crashed=False)
            if sweep in (row.get("sweep_id") or "")
        ]
        if rows == getattr(self, "shown", None):
            return
        self.shown = rows
        cursor = table.cursor_row
        table.clear()
        for row in rows:
            table.add_row(*run_cells(row, "%m-%d %H:%M"), key=row["run_id"])
        table.move_cursor(row=cursor)
        subtitle = f"{len(rows)} runs under {self.app.root}"
        if sweep:
            subtitle += f" · sweep ~ {sweep}"
        self.sub_title = subtitle

    on_input_changed = load

    def on_input_submitted(self):
        self.query_one(DataTable).focus()

    def on_data_table_row_selected(self, event: DataTable.RowSelected):
        self.app.push_screen(RunScreen(RunData(event.row_key.value, self.app.root)))
