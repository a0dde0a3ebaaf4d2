"""What the TUI shows, read from a run folder through DuckDB: read-only, one page at a time, live.

Nothing here loads a whole table: the segments, gate and request tables come a page at a time
(LIMIT/OFFSET under a stable order), and a token view reads one segment's rows.
"""

import functools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import duckdb

from workbench.store.query import resolve_run
from workbench.store.schema import TABLES

PAGE = 200
PLOTS = (
    "reward/mean",
    "loss/policy",
    "policy/entropy",
    "gate/kept_frac",
    "mismatch/kl",
    "routing/mismatch_token_frac",
    "eval/reward",
    "distill/kl",
)
SEGMENT_COLUMNS = (
    "step",
    "rollout_id",
    "segment_idx",
    "reward",
    "num_tokens",
    "versions",
    "decision",
    "seal_reason",
    "mismatched",
    "images",
)
SORT_KEYS = {
    **{c: c for c in SEGMENT_COLUMNS},
    "versions": "s.max_version",
    "images": "len(s.images)",
}


def read_runs(root: str) -> list[dict]:
    """Every run.json under `root`, newest first (read only: unlike list_runs, nothing is
    rewritten)."""
    rows = []
    for path in Path(root).glob("*/run.json"):
        try:
            rows.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    return sorted(rows, key=lambda row: row.get("created", 0), reverse=True)


@dataclass
class Filter:
    """A segments filter, parsed from words like `dropped mismatch reward>=0.5 some text`."""

    dropped: bool = False
    mismatch: bool = False
    reward_min: float = -math.inf
    reward_max: float = math.inf
    text: str = ""

    @classmethod
    def parse(cls, line: str) -> "Filter":
        found = cls()
        words = []
        for word in line.split():
            bound = re.fullmatch(r"reward(>=|<=|>|<)(-?[\d.]+(?:e-?\d+)?)", word)
            if word in ("dropped", "mismatch"):
                setattr(found, word, True)
            elif bound and ">" in bound[1]:
                found.reward_min = float(bound[2])
            elif bound:
                found.reward_max = float(bound[2])
            else:
                words.append(word)
        found.text = " ".join(words)
        return found


class RunData:
    """A run's tables as DuckDB views (`segments`, `tokens`, ...); an empty table until its first
    shard lands."""

    def __init__(self, run_id: str, root: str = "runs"):
        self.folder = resolve_run(run_id, root).resolve()
        self.db = duckdb.connect()
        self.db.execute("SET enable_progress_bar = false")
        self._present = set()
        self.pieces = {}
        self.refresh()

    def refresh(self) -> bool:
        """Re-read run.json and (re)create views for tables whose first shard appeared; True if
        anything changed."""
        self.run = json.loads((self.folder / "run.json").read_text())
        state = (
            self.run.get("status"),
            self.run.get("steps_done"),
            *(len(list((self.folder / t).glob("*.parquet"))) for t in TABLES),
        )
        changed = state != getattr(self, "state", None)
        self.state = state
        for name, schema in TABLES.items():
            if name in self._present:
                continue
            if any((self.folder / name).glob("*.parquet")):
                self.db.execute(
                    f"CREATE OR REPLACE VIEW {name} AS SELECT * FROM "
                    f"read_parquet('{self.folder / name}/*.parquet', union_by_name = true)"
                )
                self._present.add(name)
            else:
                self.db.register(f"_{name}", schema.empty_table())
                self.db.execute(f"CREATE OR REPLACE VIEW {name} AS SELECT * FROM _{name}")
        return changed

    def rows(self, sql: str, *params) -> list[tuple]:
        return self.db.execute(sql, list(params)).fetchall()

    def records(self, sql: str, *params) -> list[dict]:
        """`rows`, each as {column name: value}."""
        result = self.db.execute(sql, list(params))
        names = [d[0] for d in result.description]
        return [dict(zip(names, row, strict=True)) for row in result.fetchall()]

    # ---- overview
    def series(self, key: str) -> list[tuple[int, float]]:
        return self.rows(
            "select step, avg(value) from metrics where key = ? group by step order by step", key
        )

    def headline(self) -> dict:
        sizes = self.records(
            "select count(*) as segments, coalesce(sum(num_tokens), 0) as tokens, "
            "coalesce(sum(num_sampled), 0) as sampled from segments"
        )[0]
        stats = dict(
            self.rows(
                "select key, avg(value) from metrics "
                "where key in ('gate/kept_frac', 'mismatch/kl', 'routing/mismatch_token_frac') "
                "group by key"
            )
        )
        rewards = [value for _, value in self.series("reward/mean")]
        return {
            "status": self.run.get("status"),
            "steps": f"{self.run.get('steps_done', 0)}/{self.run.get('steps', '?')}",
            **sizes,
            "reward (last)": rewards[-1] if rewards else None,
            "reward (best)": max(rewards, default=None),
            **stats,
        }

    # ---- segments
    _SEGMENTS = """
        select s.step, s.rollout_id, s.segment_idx, s.reward, s.num_tokens,
               s.min_version || '-' || s.max_version as versions,
               coalesce(g.decision, '-') as decision, s.seal_reason,
               coalesce(r.mismatched, 0) as mismatched,
               array_to_string(s.images, ',') as images
        from segments s
        left join gate_decisions g using (step, rollout_id, segment_idx)
        left join (select step, rollout_id, segment_idx, sum(mismatched) as mismatched
                   from routing group by all) r
          using (step, rollout_id, segment_idx)
        where s.reward between ? and ?
          and (? = false or g.decision = 'dropped') and (? = false or r.mismatched > 0)
          and (? = '' or s.prompt_text ilike ? or s.response_text ilike ?)"""

    def _where(self, found: Filter) -> list:
        like = f"%{found.text}%"
        return [
            max(found.reward_min, -1e300),
            min(found.reward_max, 1e300),
            found.dropped,
            found.mismatch,
            found.text,
            like,
            like,
        ]

    def segment_count(self, found: Filter) -> int:
        return self.rows(f"select count(*) from ({self._SEGMENTS})", *self._where(found))[0][0]

    def segment_page(
        self, found: Filter, offset: int = 0, sort: str = "step", descending: bool = False
    ) -> list[tuple]:
        order = f"{SORT_KEYS.get(sort, 'step')} {'desc' if descending else 'asc'}"
        return self.rows(
            f"{self._SEGMENTS} order by {order}, step, rollout_id, segment_idx "
            f"limit {PAGE} offset {int(offset)}",
            *self._where(found),
        )

    def segment(self, step: int, rollout_id: int, segment_idx: int) -> dict:
        return self.records(
            "select * from segments where step = ? and rollout_id = ? and segment_idx = ?",
            step,
            rollout_id,
            segment_idx,
        )[0]

    def siblings(self, rollout_id: int) -> list[tuple[int, int]]:
        """(step, segment_idx) of every segment of one rollout, in order."""
        return self.rows(
            "select step, segment_idx from segments "
            "where rollout_id = ? order by segment_idx, step",
            rollout_id,
        )

    def columns(self, table: str) -> set[str]:
        """The column names of one table (a run stored by older code may lack some)."""
        return {d[0] for d in self.db.execute(f"select * from {table} limit 0").description}

    def tokens(self, step: int, rollout_id: int, segment_idx: int) -> list[dict]:
        """One segment's token rows in order, each as {column name: value}."""
        stored = self.columns("tokens")
        # null where a run was stored before the column
        optional = [name if name in stored else f"null as {name}" for name in ("entropy", "turn")]
        return self.records(
            "select position, token_id, loss_mask, behavior_logprob, train_logprob, "
            f"behavior_version, is_weight, advantage, {', '.join(optional)} "
            "from tokens where step = ? and rollout_id = ? and segment_idx = ? order by position",
            step,
            rollout_id,
            segment_idx,
        )

    def routing(self, step: int, rollout_id: int, segment_idx: int) -> dict[int, dict[int, tuple]]:
        """Layer -> {position: (rollout experts, learner experts)} where the learner's live routing
        disagreed."""
        layers = self.rows(
            "select layer, positions, rollout_experts, learner_experts from routing "
            "where step = ? and rollout_id = ? and segment_idx = ? order by layer",
            step,
            rollout_id,
            segment_idx,
        )
        routing = {}
        for layer, positions, rollout, learner in layers:
            experts = zip(rollout or [], learner or [], strict=True)
            routing[layer] = dict(zip(positions or [], experts, strict=True))
        return routing

    # ---- other tables
    def page(self, table: str, offset: int = 0) -> tuple[list[str], list[tuple]]:
        order = "step, rollout_id, segment_idx" if table == "gate_decisions" else "time"
        # the traceback: below the table
        exclude = "run_id, traceback" if table == "failed_episodes" else "run_id"
        result = self.db.execute(
            f"select * exclude ({exclude}) from {table} "
            f"order by {order} limit {PAGE} offset {int(offset)}"
        )
        return [d[0] for d in result.description], result.fetchall()

    def traceback(self, step: int, rollout_id: int) -> str:
        found = self.rows(
            "select traceback from failed_episodes where step = ? and rollout_id = ? limit 1",
            step,
            rollout_id,
        )
        return found[0][0] if found else ""

    # ---- token text
    def piece(self, token_id: int) -> str:
        """The text of one token under the run's tokenizer (cached); `⟨id⟩` when the tokenizer
        cannot be found."""
        if token_id not in self.pieces:
            self.pieces[token_id] = f"⟨{token_id}⟩"
            if self.tokenizer:
                self.pieces[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return self.pieces[token_id]

    @property
    def model(self) -> dict:
        """The run's `model` config."""
        return (self.run.get("config") or {}).get("model") or {}

    @functools.cached_property
    def tokenizer(self):
        """The run's tokenizer, loaded once; None where it cannot be found."""
        try:
            from tokenizers import Tokenizer

            if self.model.get("path"):
                folder = Path(self.model["path"])
            else:
                from workbench.models.tiny import tiny_model_path

                folder = tiny_model_path(self.model.get("name", "tiny"))
            return Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception:
            # a model folder moved or gone: ids are still shown
            return None
