"""CLI commands with more than a few lines of their own: `eaglebatch bench` (bench),
`eaglebatch run-batch` (run_batch) and `eaglebatch status` (status). cli.py parses the arguments
and calls them; they sit above the engine and the wings."""
