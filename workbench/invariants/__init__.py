"""One module per correctness invariant, each stating it in its first sentence."""
