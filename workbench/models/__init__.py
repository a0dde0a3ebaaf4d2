"""The policies: the tiny models the project builds offline, loading a checkpoint (text or
vision-language), LoRA adapters, the learner's packed and shared-prefix forwards, and the learner's
part of a checkpoint (state.py). How a model is built, loaded or run in the learner changes here."""
