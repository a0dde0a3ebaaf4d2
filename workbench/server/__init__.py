"""The loopback server: its wires (OpenAI, Anthropic; one object each) onto a rollout engine,
token-exact. How an agent's HTTP request becomes engine calls and Segments changes here."""
