"""The rollout worker actor: episodes of an Env or a ChatAgent on an engine, behind the loopback
server, returned as token-exact Segments. How an episode is run changes here."""
