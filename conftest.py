# Registers the recipe test harness for this repository. Other repositories load it with
# `pytest -p miles.testing`.
pytest_plugins = ["miles.testing"]
