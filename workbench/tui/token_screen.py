"""The token view of one segment: every token's text, each sampled one coloured by a channel, and a
side panel with the values of the token under the cursor.

Prompt and environment tokens are dim; ▸ ◂ mark a sampled turn, ▣ an image. The channels are in
`channels.py`. A vision-language segment's images are drawn under the side panel by textual-image.
"""

import os

import textual_image.renderable
from rich.text import Text
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Header, Static
from textual_image.widget import HalfcellImage, Image

from workbench.invariants.token_identity import FORCED_VERSION
from workbench.tui.channels import CHANNELS, GAP_PARTS, colour, dominant_gap
from workbench.tui.data import RunData

# textual-image draws with sixel or the kitty protocol where the terminal answers for one, else in
# half-block cells; off a terminal (headless) it would draw grey shades. Half-block cells there, and
# on MOLT_WB_IMAGES=cells: a tmux built with sixel claims it where the terminal outside has none
SegmentImage = Image
if (
    os.environ.get("MOLT_WB_IMAGES") == "cells"
    or textual_image.renderable.Image is textual_image.renderable.UnicodeImage
):
    SegmentImage = HalfcellImage


def visible(piece):
    """A token's text as it may be drawn: newlines kept (after a ↵), other control characters
    escaped."""
    escaped = "".join(c if c.isprintable() or c == "\n" else repr(c)[1:-1] for c in piece)
    return escaped.replace("\n", "↵\n")


def _experts(ids):
    if ids is None:
        return "?"
    return ",".join(map(str, ids))


class TokenScreen(Screen):
    BINDINGS = [
        Binding("left", "move(-1)", "Token ←", show=False),
        Binding("right", "move(1)", "Token →", show=False),
        Binding("home", "move(-1e9)", show=False),
        Binding("end", "move(1e9)", show=False),
        Binding("full_stop", "next_sampled", "Next sampled", key_display="."),
        ("c", "channel", "Channel"),
        ("n", "segment(1)", "Next seg"),
        ("p", "segment(-1)", "Prev seg"),
        ("escape", "app.pop_screen", "Back"),
    ]

    def __init__(self, data: RunData, step, rollout_id, segment_idx):
        super().__init__()
        self.data = data
        # a LoRA run's versions are its adapter's (models/lora.py)
        self.version_label = "version"
        if (data.model.get("lora") or {}).get("rank"):
            self.version_label = "adapter"
        self.channel = next(iter(CHANNELS))
        self.cursor = 0
        self.open((step, rollout_id, segment_idx))

    def open(self, key):
        """Show the segment whose key is (step, rollout_id, segment_idx)."""
        self.segment_key = key
        self.segment = self.data.segment(key)
        routing = self.data.routing(key)
        self.rollout_segments = self.data.siblings(self.segment["rollout_id"])
        self.route_layers = sorted(routing)
        self.tokens = self.data.tokens(key)
        for token in self.tokens:
            token["text"] = self.data.piece(token["token_id"])
            token["staleness"] = self.segment["learner_version"] - token["behavior_version"]
            token["mismatched_layers"] = {
                layer: routing[layer][token["position"]]
                for layer in self.route_layers
                if token["position"] in routing[layer]
            }
        self.cursor = min(self.cursor, max(len(self.tokens) - 1, 0))

    def compose(self):
        yield Header()
        yield Static(id="legend")
        with Horizontal():
            with VerticalScroll(id="tokens-scroll", can_focus=False):
                yield Static(id="tokens")
            with Vertical(id="side-column"):
                yield Static(id="side")
                yield VerticalScroll(id="images", can_focus=False)
        yield Footer()

    def on_mount(self):
        self.render_all()
        self.show_images()

    def show_images(self):
        """The segment's image files under the side panel; no panel for a segment without."""
        panel = self.query_one("#images", VerticalScroll)
        panel.remove_children()
        files = [self.data.folder / "images" / name for name in self.segment["images"]]
        # a run folder copied without its images still opens
        files = [path for path in files if path.exists()]
        panel.display = bool(files)
        panel.mount_all(SegmentImage(path) for path in files)

    def render_all(self):
        s = self.segment
        self.title = (
            f"rollout {s['rollout_id']} · segment {s['segment_idx'] + 1}/"
            f"{len(self.rollout_segments)} · step {s['step']}"
        )
        self.sub_title = (
            f"reward {s['reward']:.3g} · seal {s['seal_reason']} · finish {s['finish_reason']}"
        )
        # rich markup: channel names, labels and image names hold no [
        legend = f"[b]channel [u]{self.channel}[/u][/b]  [dim]prompt/env[/dim]  "
        legend += "".join(f"[{c}]■ {label} [/]" for _, c, label in CHANNELS[self.channel][1])
        if s["images"]:
            legend += f"\n[i]images: {', '.join(s['images'])}[/i]"
        self.query_one("#legend", Static).update(Text.from_markup(legend))
        text = Text()
        starts = {a for a, _ in s["turn_spans"]}
        ends = {b for _, b in s["turn_spans"]}
        images = iter(s["images"])
        for i, token in enumerate(self.tokens):
            style = _style(self.channel, token)
            if i in ends:
                text.append("◂", style="bold magenta")
            if i in starts:
                text.append("▸", style="bold magenta")
            piece = token["text"]
            if piece == "<|vision_start|>":
                piece = f"▣{next(images, 'image')}"
            elif piece == "<|image_pad|>":
                piece = "▪"
            if i == self.cursor:
                self.cursor_offset = len(text)
                style += " reverse"
            text.append(visible(piece), style=style)
        if len(self.tokens) in ends:
            text.append("◂", style="bold magenta")
        text.append(f" ⏹ {s['seal_reason']}", style="bold")
        self.text = text
        self.query_one("#tokens", Static).update(text)
        self.render_side()
        self.call_after_refresh(self.follow)

    def follow(self):
        """Scroll so the cursor's line is in view (lines as rich wraps them at the pane's width)."""
        scroll = self.query_one("#tokens-scroll", VerticalScroll)
        width, height = scroll.scrollable_content_region.size
        if width > 0 and self.tokens:
            line = len(self.text[: self.cursor_offset + 1].wrap(self.app.console, width)) - 1
            if not scroll.scroll_y <= line < scroll.scroll_y + height:
                scroll.scroll_to(y=max(0, line - height // 2), animate=False)

    def render_side(self):
        if not self.tokens:
            self.query_one("#side", Static).update("no tokens stored")
            return
        t = self.tokens[self.cursor]
        lines = [
            f"[b]token[/b] {t['position'] + 1}/{len(self.tokens)}",
            f"id        {t['token_id']}",
            f"text      {t['text']!r}",
            f"kind      {_kind(t)}",
        ]
        if t["loss_mask"]:
            lines += [
                f"behavior  {t['behavior_logprob']:.4f}",
                f"train     {t['train_logprob']:.4f}",
                f"δ         {t['train_logprob'] - t['behavior_logprob']:+.4f}",
                f"{self.version_label:<10}{t['behavior_version']} "
                f"(learner {self.segment['learner_version']})",
                f"IS weight {t['is_weight']:.4f}",
            ]
            if t["entropy"] is not None:
                lines.append(f"entropy   {t['entropy']:.4f}")
            if t["turn"] is not None:
                reward = self.segment["turn_rewards"][t["turn"]]
                lines.append(f"turn      {t['turn'] + 1} (reward {reward:.4g})")
            lines.append(f"advantage {t['advantage']:+.4f}")
            cause = dominant_gap(t)
            if cause is not None:
                parts = " ".join(f"{name[:5]} {t['gap_' + name]:+.3g}" for name in GAP_PARTS)
                lines.append(f"gap       {parts} (most: {GAP_PARTS[cause]})")
        else:
            lines.append(f"train     {t['train_logprob']:.4f}")
        if self.route_layers:
            lines.append(
                "routing   "
                + " ".join(
                    f"L{layer}{'✗' if layer in t['mismatched_layers'] else '✓'}"
                    for layer in self.route_layers
                )
            )
            lines += [
                f"  L{layer} rollout {_experts(rollout)} learner {_experts(learner)}"
                for layer, (rollout, learner) in t["mismatched_layers"].items()
            ]
        self.query_one("#side", Static).update("\n".join(lines))

    def action_move(self, delta):
        self.cursor = int(min(max(self.cursor + delta, 0), max(len(self.tokens) - 1, 0)))
        self.render_all()

    def action_next_sampled(self):
        later = range(self.cursor + 1, len(self.tokens))
        sampled = (i for i in later if self.tokens[i]["loss_mask"])
        # no sampled token after the cursor: stay
        self.action_move(next(sampled, self.cursor) - self.cursor)

    def action_channel(self):
        names = list(CHANNELS)
        self.channel = names[(names.index(self.channel) + 1) % len(names)]
        self.render_all()

    def action_segment(self, delta):
        step, rollout_id, segment_idx = self.segment_key
        index = self.rollout_segments.index((step, segment_idx)) + delta
        if 0 <= index < len(self.rollout_segments):
            step, segment_idx = self.rollout_segments[index]
            self.open((step, rollout_id, segment_idx))
            self.render_all()
            self.show_images()


def _kind(token):
    if token["loss_mask"]:
        return "sampled"
    if token["behavior_version"] == FORCED_VERSION:
        return "forced (inserted by the server, not sampled)"
    return "prompt/env"


def _style(channel, token):
    """A sampled token in the channel's colour; a forced one underlined; the rest dim."""
    if token["loss_mask"]:
        return colour(channel, token)
    if token["behavior_version"] == FORCED_VERSION:
        return "underline"
    return "dim"
