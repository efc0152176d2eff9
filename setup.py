"""Package discovery for the mapped source folders (the rest of the metadata is in pyproject.toml).

The engine, models, server and model cards live at the top of the repository but install as
mtp_serve.engine, mtp_serve.models, mtp_serve.server and mtp_serve.configs. Every package under
them is found here, so a new subpackage ships without anyone listing it.
"""

from setuptools import find_packages, setup

MAPPED = {
    "mtp_serve.engine": "engine",
    "mtp_serve.models": "models",
    "mtp_serve.server": "server",
    "mtp_serve.configs": "configs",
}


def packages() -> list[str]:
    found = find_packages(include=["mtp_serve", "mtp_serve.*"])
    for name, folder in MAPPED.items():
        found += [name] + [f"{name}.{sub}" for sub in find_packages(folder)]
    return found


setup(packages=packages(), package_dir=MAPPED)
