"""molt-wb's shipped Hydra configs, installed as the package `workbench.conf` so that every install
finds them as `pkg://workbench.conf` from any folder (workbench/locate.py)."""
