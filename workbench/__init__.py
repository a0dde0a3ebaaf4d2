"""molt-wb: a CLI-first research workbench for agentic RL on language models.

Importing this package is cheap: ray, vllm, textual and wandb load only where they are used.
"""

__version__ = "0.1.0"
