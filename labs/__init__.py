"""labs/: six exercises on this system, each a stub a student fills in and a pytest grader (README.md), and
sync_grpo.py, the synchronous loop the system makes asynchronous."""
