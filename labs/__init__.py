"""labs/: five exercises on this system, each a stub a student fills in and a pytest grader (README.md)."""
