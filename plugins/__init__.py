"""molt-wb's shipped agent plugins, installed as the package `workbench.plugins`:
`agent.plugin=NAME` imports `workbench.plugins.NAME` (workbench/locate.py)."""
