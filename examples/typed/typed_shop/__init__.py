"""A small typed project using taskflow's public API: `mypy --strict` checks it in CI (see README.md)."""
