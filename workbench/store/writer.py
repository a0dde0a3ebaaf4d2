"""The single writer of a run folder: buffered rows, flushed as whole Parquet shards.

Invariant: every shard a reader can see is complete. A shard is written under a hidden temporary
name and renamed into place, so a crash loses at most the rows buffered since the last flush and
never leaves half a file behind. `flush_every` adds a timer, so rows reach disk within
`flush_seconds` even while a long step is running.
"""

import json
import os
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from workbench.segment import image_name
from workbench.store.schema import TABLES


def write_json_atomic(path: Path, payload):
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(json.dumps(payload, indent=1, default=str))
    os.replace(temporary, path)


class RunWriter:
    def __init__(self, run_dir, run_row, flush_rows=50_000, flush_seconds=5.0):
        self.run_dir = Path(run_dir)
        self.flush_rows = flush_rows
        self.flush_seconds = flush_seconds
        # each table's pa.Tables buffered since the last flush
        self.buffers = {name: [] for name in TABLES}
        # the flush timer runs on its own thread
        self.lock = threading.RLock()
        self.closed = False
        self.next_shard = {}
        for name, schema in TABLES.items():
            folder = self.run_dir / name
            folder.mkdir(parents=True, exist_ok=True)
            self.next_shard[name] = len(list(folder.glob("part-*.parquet")))
            # an empty shard keeps `read_parquet(folder/*)` valid from the start
            if self.next_shard[name] == 0:
                self._write_shard(name, schema.empty_table())
        self.last_flush = time.monotonic()
        self.run_row = dict(run_row)
        self.update_run()

    def append(self, table, rows: pa.Table):
        rows = rows.cast(TABLES[table])
        with self.lock:
            self.buffers[table].append(rows)

    def flush_every(self, seconds):
        """Flush buffered rows every `seconds` on a daemon thread, until close."""

        def run():
            while not self.closed:
                time.sleep(seconds)
                self.maybe_flush()

        threading.Thread(target=run, daemon=True, name="flush-timer").start()

    def maybe_flush(self):
        """Flush when rows are buffered and `flush_seconds` have passed or `flush_rows` are in."""
        with self.lock:
            due = time.monotonic() - self.last_flush >= self.flush_seconds
            rows = sum(table.num_rows for tables in self.buffers.values() for table in tables)
            if rows and (due or rows >= self.flush_rows):
                self.flush()

    def flush(self):
        with self.lock:
            for name, tables in self.buffers.items():
                if tables:
                    self._write_shard(name, pa.concat_tables(tables))
                    tables.clear()
            # the row's progress, as far as the data just written
            if self.row_pending:
                self.update_run()
            self.last_flush = time.monotonic()

    def save_images(self, images):
        """Keep each encoded image once, by content hash, under images/ (atomically, like the
        shards)."""
        for image in images:
            final = self.run_dir / "images" / image_name(image)
            if not final.exists():
                final.parent.mkdir(exist_ok=True)
                temporary = final.with_name(f".{final.name}.tmp")
                temporary.write_bytes(image)
                os.replace(temporary, final)

    def update_run(self, at_flush=False, **fields):
        """Rewrite the `runs` row (status, steps done, last reward, ...) atomically; `at_flush`:
        with the next flush of the data (a step's progress: the row holds the whole config, too big
        to rewrite every step)."""
        with self.lock:
            self.run_row.update(fields, updated=time.time())
            self.row_pending = at_flush
            if not at_flush:
                write_json_atomic(self.run_dir / "run.json", self.run_row)

    def close(self, status="finished"):
        with self.lock:
            self.closed = True
            self.flush()
            self.update_run(status=status)

    def _write_shard(self, name, table: pa.Table):
        folder = self.run_dir / name
        final = folder / f"part-{self.next_shard[name]:06d}.parquet"
        temporary = folder / f".{final.name}.tmp"
        pq.write_table(table, temporary, compression="zstd")
        os.replace(temporary, final)
        self.next_shard[name] += 1
