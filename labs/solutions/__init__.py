"""The labs' reference solutions, mostly thin wrappers over the project's own code (labs/TEACHER.md). Not for
the students: hand out the repository without this folder."""
