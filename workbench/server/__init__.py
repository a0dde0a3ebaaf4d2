"""The loopback server: OpenAI and Anthropic wires onto a rollout engine, token-exact."""
