"""The loopback server: its wires (OpenAI, Anthropic; one object each) onto a rollout engine,
token-exact."""
