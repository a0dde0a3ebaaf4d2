"""The policies: the tiny models the project builds offline, loading a checkpoint (text or
vision-language), LoRA adapters, and the learner's packed and shared-prefix forwards. How a model
is built, loaded or run in the learner changes here."""
