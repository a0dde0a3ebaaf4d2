"""The one part of the build that pyproject.toml cannot state: the repository's top-level `conf/`
and `plugins/` folders go into the installed package as `workbench.conf` and `workbench.plugins`,
beside every package under `workbench/` (found, not listed: a static list would leave a new
subpackage out of the wheel without a word)."""

from setuptools import find_namespace_packages, find_packages, setup

# installed package name -> folder of the repository that holds it
SHIPPED_FOLDERS = {"workbench.conf": "conf", "workbench.plugins": "plugins"}
# conf/'s groups (conf/recipe, ...): folders of YAML files, installed as data of namespace packages
CONFIG_GROUPS = [f"workbench.conf.{group}" for group in find_namespace_packages(where="conf")]

setup(
    packages=find_packages(include=["workbench", "workbench.*"])
    + list(SHIPPED_FOLDERS)
    + CONFIG_GROUPS,
    package_dir=SHIPPED_FOLDERS,
    # and the loopback server's request-field classification, beside its wires
    package_data={
        **{name: ["*.yaml"] for name in ["workbench.conf", *CONFIG_GROUPS]},
        "workbench.server.wires": ["fields.toml"],
    },
)
