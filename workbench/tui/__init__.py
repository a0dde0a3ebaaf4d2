"""The terminal UI of `molt-wb inspect`: runs, plots, segments and every token, read from the run
store. What a reader sees of a run changes here; nothing here writes to it."""
