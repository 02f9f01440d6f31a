"""The labs' reference solutions: thin wrappers over the project's own code (or README.md's Fork it)."""
