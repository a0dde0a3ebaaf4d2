"""Rollout engines behind one protocol (engines/base.py)."""
