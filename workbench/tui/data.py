"""What the TUI shows, read from a run folder through DuckDB: read-only, one page at a time, live.

Nothing here loads a whole table: the segments, gate and request tables come a page at a time
(LIMIT/OFFSET under a stable order), and a token view reads one segment's rows.
"""

import functools
import math
import re
from dataclasses import dataclass
from pathlib import Path

from workbench.models.pretrained import held_folder
from workbench.store.alarms import FIRED
from workbench.store.nonfinite import FIRST_STEPS
from workbench.store.query import connect, resolve_run, run_row
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
# a segments column sorts by its own value, but these
SORT_EXPRESSIONS = {"versions": "s.max_version", "images": "len(s.images)"}


@dataclass
class Filter:
    """A segments filter, parsed from words like `dropped mismatch reward>=0.5 some text`."""

    dropped: bool = False
    mismatch: bool = False
    reward_min: float = -math.inf
    reward_max: float = math.inf
    text: str = ""

    @classmethod
    def parse(cls, line):
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
    """A run's tables as DuckDB views (`segments`, `tokens`, ...), each with every column of its
    schema: an empty table until its first shard lands, null in a column older shards lack."""

    def __init__(self, run_id, root="runs"):
        self.folder = resolve_run(run_id, root).resolve()
        self.db = connect()
        self.db.execute("SET enable_progress_bar = false")
        self._present = set()
        self.pieces = {}
        self.refresh()

    def refresh(self):
        """Re-read run.json and (re)create views for tables whose first shard appeared; True if
        anything changed."""
        self.run = run_row(self.folder)
        shards = {name: len(list((self.folder / name).glob("*.parquet"))) for name in TABLES}
        state = (self.run.get("status"), self.run.get("steps_done"), *shards.values())
        changed = state != getattr(self, "state", None)
        self.state = state
        for name, schema in TABLES.items():
            if name in self._present:
                continue
            self.db.register(f"_{name}", schema.empty_table())
            source = f"_{name}"
            if shards[name]:
                source += (
                    " UNION ALL BY NAME SELECT * FROM "
                    f"read_parquet('{self.folder / name}/*.parquet', union_by_name = true)"
                )
                self._present.add(name)
            self.db.execute(f"CREATE OR REPLACE VIEW {name} AS SELECT * FROM {source}")
        return changed

    def rows(self, sql, params=()):
        """The rows of a query; `params`: its ? values in order, or its $name values by name."""
        return self.db.execute(sql, params).fetchall()

    def records(self, sql, params=()):
        """`rows`, each as {column name: value}."""
        result = self.db.execute(sql, params)
        names = [d[0] for d in result.description]
        return [dict(zip(names, row, strict=True)) for row in result.fetchall()]

    # ---- overview
    def series(self, key):
        return self.rows(
            "select step, avg(value) from metrics where key = ? group by step order by step", [key]
        )

    def headline(self):
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
        # every key that held a NaN or inf, and the step it started at (store/nonfinite.py)
        nonfinite = [f"{key} from step {first}" for key, first, *_ in self.rows(FIRST_STEPS)]
        # the run-health rules that fired (store/alarms.py)
        alarms = [f"{rule} at step {step}" for step, rule, _ in self.rows(FIRED)]
        return {
            "status": self.run.get("status"),
            "steps": f"{self.run.get('steps_done', 0)}/{self.run.get('steps', '?')}",
            **sizes,
            "reward (last)": rewards[-1] if rewards else None,
            "reward (best)": max(rewards, default=None),
            **stats,
            "non-finite": ", ".join(nonfinite) or "none",
            "alarms": ", ".join(alarms) or "none",
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
        where s.reward between $reward_min and $reward_max
          and (not $dropped or g.decision = 'dropped') and (not $mismatch or r.mismatched > 0)
          and ($text = '' or s.prompt_text ilike '%' || $text || '%'
               or s.response_text ilike '%' || $text || '%')"""

    def segment_count(self, found: Filter):
        return self.rows(f"select count(*) from ({self._SEGMENTS})", vars(found))[0][0]

    def segment_page(self, found: Filter, offset, sort, descending):
        order = f"{SORT_EXPRESSIONS.get(sort, sort)} {'desc' if descending else 'asc'}"
        return self.rows(
            f"{self._SEGMENTS} order by {order}, step, rollout_id, segment_idx "
            f"limit {PAGE} offset {int(offset)}",
            vars(found),
        )

    # ---- one segment, by its key (step, rollout_id, segment_idx)
    def segment(self, key):
        return self.records(
            "select * from segments where step = ? and rollout_id = ? and segment_idx = ?", key
        )[0]

    def siblings(self, rollout_id):
        """(step, segment_idx) of every segment of one rollout, in order."""
        return self.rows(
            "select step, segment_idx from segments "
            "where rollout_id = ? order by segment_idx, step",
            [rollout_id],
        )

    def tokens(self, key):
        """One segment's token rows in order, each as {column name: value}."""
        return self.records(
            # every column: a run older than one (the gap's parts) reads without it
            "select * exclude (run_id, step, rollout_id, segment_idx) "
            "from tokens where step = ? and rollout_id = ? and segment_idx = ? order by position",
            key,
        )

    def routing(self, key):
        """Layer -> {position: (rollout experts, learner experts)} where the learner's live routing
        disagreed."""
        layers = self.rows(
            "select layer, positions, rollout_experts, learner_experts from routing "
            "where step = ? and rollout_id = ? and segment_idx = ? order by layer",
            key,
        )
        routing = {}
        for layer, positions, rollout, learner in layers:
            experts = zip(rollout or [], learner or [], strict=True)
            routing[layer] = dict(zip(positions or [], experts, strict=True))
        return routing

    # ---- other tables
    def page(self, table, offset):
        order = "step, rollout_id, segment_idx" if table == "gate_decisions" else "time"
        # the traceback: below the table
        exclude = "run_id, traceback" if table == "failed_episodes" else "run_id"
        result = self.db.execute(
            f"select * exclude ({exclude}) from {table} "
            f"order by {order} limit {PAGE} offset {int(offset)}"
        )
        return [d[0] for d in result.description], result.fetchall()

    def traceback(self, step, rollout_id):
        return self.rows(
            "select coalesce(first(traceback), '') from failed_episodes "
            "where step = ? and rollout_id = ?",
            [step, rollout_id],
        )[0][0]

    # ---- token text
    def piece(self, token_id):
        """The text of one token under the run's tokenizer (cached); `⟨id⟩` when the tokenizer
        cannot be found."""
        if token_id not in self.pieces:
            self.pieces[token_id] = f"⟨{token_id}⟩"
            if self.tokenizer:
                self.pieces[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return self.pieces[token_id]

    @property
    def model(self):
        """The run's `model` config."""
        return (self.run.get("config") or {}).get("model") or {}

    @functools.cached_property
    def tokenizer(self):
        """The run's tokenizer, loaded once; None where it cannot be found."""
        try:
            from tokenizers import Tokenizer

            folder = held_folder(self.model.get("name", "tiny"), self.model.get("path"))
            return Tokenizer.from_file(str(Path(folder, "tokenizer.json")))
        except Exception:
            # a model folder moved or gone: ids are still shown
            return None
