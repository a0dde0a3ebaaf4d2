"""One module per correctness invariant, each stating it in its first sentence: token identity,
the version gate, routing replay. A change to what a run guarantees is made here, and only here."""
